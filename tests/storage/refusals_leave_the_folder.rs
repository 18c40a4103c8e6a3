//! A database refused at open (a newer schema, an older one not to be migrated, a truncated
//! or damaged file, a file that is not a database) leaves its folder exactly as it was: the
//! same files with the same bytes, and no `-wal` or `-shm` beside it.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use agentrt::{Error, SCHEMA_VERSION, Store, sqlite, testkit::TempStore};

use crate::support::entries;

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

/// The ways to open a database file that only read it.
const READING: &[&str] = &["open_read_only", "schema_status", "quick_check"];
/// The ways that would write it.
const WRITING: &[&str] = &["open", "existing_only", "connect"];

/// Opens the database at `path` the way `door` names.
fn open_by(door: &str, path: PathBuf) -> agentrt::Result<()> {
    match door {
        "open_read_only" => Store::open_read_only(path).map(drop),
        "schema_status" => sqlite::schema_status(path).map(drop),
        "quick_check" => sqlite::quick_check(path).map(drop),
        "open" => Store::open(path).map(drop),
        "existing_only" => sqlite::Options::existing_only().open(path).map(drop),
        "connect" => Store::connect(&path.display().to_string()).map(drop),
        other => unreachable!("{other}"),
    }
}

/// Opens `path` the way `door` names, on a thread of its own, and gives its error; fails the
/// test if it opens, or is still waiting after far longer than a refusal takes: it hangs.
fn refused_at_once(door: &'static str, path: &Path) -> Error {
    let (answer, answered) = std::sync::mpsc::channel();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = answer.send(open_by(door, path).err());
    });
    answered
        .recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{door}: the open hangs"))
        .unwrap_or_else(|| panic!("{door}: opened"))
}

/// Every way to open a database file is refused on `path`, at once, naming what it is, with
/// nothing opened or created beside it. `writing`: the ways that would write a database too.
fn every_open_refuses(path: &Path, what: &str, writing: bool) {
    let dir = path.parent().unwrap();
    let before = entries(dir);
    let doors = READING.iter().chain(if writing { WRITING } else { &[] });
    for &door in doors {
        let err = refused_at_once(door, path);
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidInput(_)), "{door}: {text}");
        assert!(
            text.contains(&format!(
                "{} is {what}, not a database file",
                path.display()
            )),
            "{door}: {text}"
        );
        assert_eq!(entries(dir), before, "{door} on {what}");
    }
}

#[test]
fn a_named_pipe_a_socket_or_a_device_is_refused_unopened_whatever_the_way_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.db");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    every_open_refuses(&fifo, "a named pipe (FIFO)", true);

    let socket = dir.path().join("socket.db");
    let _listening = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    every_open_refuses(&socket, "a socket", true);

    // Only the read-only ways: SQLite would write a device as a database, and its journal
    // beside it.
    every_open_refuses(Path::new("/dev/null"), "a character device", false);
}
