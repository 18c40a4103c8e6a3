//! A database refused at open (a newer schema, an older one not to be migrated, a truncated
//! or damaged file, a file that is not a database) leaves its folder exactly as it was: the
//! same files with the same bytes, and no `-wal` or `-shm` beside it.

use std::{collections::BTreeMap, path::Path};

use agentrt::{Error, SCHEMA_VERSION, Store, sqlite, testkit::TempStore};

/// Every file of `dir` with its length and a digest of its bytes.
fn folder(dir: &Path) -> BTreeMap<String, (usize, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let bytes = std::fs::read(entry.path()).unwrap();
            let digest = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
                (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
            });
            (name, (bytes.len(), digest))
        })
        .collect()
}

/// An agentrt database as a previous process left it: in WAL mode, closed cleanly.
fn agentrt_database(db: &TempStore) {
    let store = db.open();
    store.runs(None).unwrap();
    drop(store);
    assert!(!db.dir().join("agentrt.db-wal").exists(), "closed cleanly");
}

fn refused(db: &TempStore, open: impl Fn() -> agentrt::Result<Store>) -> Error {
    let before = folder(db.dir());
    let err = open().expect_err("the database is refused");
    assert_eq!(
        folder(db.dir()),
        before,
        "the folder changed when {err} was refused"
    );
    err
}

#[test]
fn a_newer_schema_is_refused_and_its_folder_left_as_it_was() {
    let db = TempStore::sqlite();
    agentrt_database(&db);
    rusqlite::Connection::open(db.path())
        .unwrap()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let err = refused(&db, || Store::open(db.path()));
    assert!(matches!(err, Error::SchemaTooNew { .. }), "{err}");
    // Reading the version, as `agentrt migrate` does first, creates nothing either.
    let before = folder(db.dir());
    let status = sqlite::schema_status(db.path()).unwrap();
    assert_eq!(
        (status.found, status.supported),
        (SCHEMA_VERSION + 1, SCHEMA_VERSION)
    );
    assert_eq!(folder(db.dir()), before);
}

#[test]
fn an_older_schema_not_to_be_migrated_is_refused_and_its_folder_left_as_it_was() {
    let db = TempStore::sqlite();
    agentrt::testkit::database_at_schema(&db.path(), SCHEMA_VERSION - 1);
    rusqlite::Connection::open(db.path())
        .unwrap()
        .pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))
        .unwrap();
    let err = refused(&db, || sqlite::Options::existing_only().open(db.path()));
    assert!(matches!(err, Error::SchemaOutdated { .. }), "{err}");
}

#[test]
fn a_truncated_database_is_refused_naming_the_file_and_its_folder_left_as_it_was() {
    let db = TempStore::sqlite();
    agentrt_database(&db);
    let bytes = std::fs::read(db.path()).unwrap();
    // A copy cut short: the header promises pages that are not there.
    std::fs::write(db.path(), &bytes[..bytes.len() / 2]).unwrap();
    let err = refused(&db, || Store::open(db.path()));
    let text = err.to_string();
    assert!(
        matches!(err, Error::DatabaseCorrupt { .. }),
        "a truncated file is damaged: {text}"
    );
    assert!(text.contains(&db.path().display().to_string()), "{text}");
    assert!(text.contains("backup"), "says what to do: {text}");
}

#[test]
fn a_damaged_database_is_refused_naming_the_file_and_its_folder_left_as_it_was() {
    let db = TempStore::sqlite();
    agentrt_database(&db);
    let mut bytes = std::fs::read(db.path()).unwrap();
    // Garbage over every page after the first: the schema's pages among them.
    for byte in &mut bytes[4096..] {
        *byte = 0x5a;
    }
    std::fs::write(db.path(), &bytes).unwrap();
    let err = refused(&db, || Store::open(db.path()));
    let text = err.to_string();
    assert!(matches!(err, Error::DatabaseCorrupt { .. }), "{text}");
    assert!(text.contains(&db.path().display().to_string()), "{text}");
}

#[test]
fn a_file_that_is_not_a_database_is_refused_and_its_folder_left_as_it_was() {
    let db = TempStore::sqlite();
    std::fs::write(
        db.path(),
        b"not a database, just some bytes that are long enough",
    )
    .unwrap();
    let err = refused(&db, || Store::open(db.path()));
    assert!(matches!(err, Error::NotADatabase { .. }), "{err}");
    let err = refused(&db, || sqlite::Options::existing_only().open(db.path()));
    assert!(matches!(err, Error::NotADatabase { .. }), "{err}");
}

#[test]
fn a_database_whose_path_is_not_ascii_opens_again() {
    let db = TempStore::sqlite();
    let dir = db.dir().join("café données");
    std::fs::create_dir(&dir).unwrap();
    let path = dir.join("agents ✓.db");
    drop(Store::open(&path).unwrap());
    assert_eq!(sqlite::schema_status(&path).unwrap().found, SCHEMA_VERSION);
    let store = Store::open(&path).unwrap();
    assert!(store.runs(None).unwrap().is_empty());
}

#[cfg(unix)]
#[test]
fn a_newer_schema_still_in_the_log_is_found_through_a_symbolic_link() {
    let db = TempStore::sqlite();
    agentrt_database(&db);
    let link = db.dir().join("link.db");
    std::os::unix::fs::symlink(db.path(), &link).unwrap();
    // A newer agentrt upgraded the file; its commit is still in the log, which a connection
    // it keeps open stops SQLite from copying back and removing.
    let holder = rusqlite::Connection::open(db.path()).unwrap();
    holder.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
    holder
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    assert!(db.dir().join("agentrt.db-wal").exists());

    assert_eq!(
        sqlite::schema_status(&link).unwrap().found,
        SCHEMA_VERSION + 1,
        "the version in the log, not the header's"
    );
    for open in [
        sqlite::Options::new().migrate(false).open(&link),
        Store::open(&link),
    ] {
        let err = open.unwrap_err();
        assert!(matches!(err, Error::SchemaTooNew { .. }), "{err}");
    }
    drop(holder);
}
