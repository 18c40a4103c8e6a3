//! Opening SQLite connections: the pragmas every connection gets, the hardening, the
//! migrations, and the refusals that leave a file as it was.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, TransactionBehavior, config::DbConfig};
use rusqlite_migration::{M, Migrations};

use super::{
    error::db_error,
    options::{Options, Synchronous},
};
use crate::error::{Error, Result};
use crate::store::{SCHEMA_VERSION, SchemaStatus, schema::MIGRATIONS};

/// The migrations, in order, as `rusqlite_migration` applies them.
pub(crate) fn migrations() -> Migrations<'static> {
    Migrations::new(
        MIGRATIONS
            .iter()
            .map(
                |(name, sql)| match REBUILDS.iter().find(|(file, _)| file == name) {
                    // Runs with foreign keys off (see `migrate`): the references of the tables it
                    // touched are checked before it commits.
                    Some((_, tables)) => M::up_with_hook(sql, move |tx: &rusqlite::Transaction| {
                        check_references(tx, tables)
                    }),
                    None => M::up(sql),
                },
            )
            .collect(),
    )
}

/// Migrations that copy a table into a new one (SQLite cannot change a constraint in place):
/// they need foreign keys off while the old table is dropped, and the references from and to
/// the rebuilt table are checked afterwards (only those: the events table may be large).
const REBUILDS: &[(&str, &[&str])] = &[
    ("0006_steps_state_check.sql", &["steps", "approvals"]),
    ("0007_steps_waiting_call_index.sql", &["steps", "approvals"]),
    ("0012_waits.sql", &["steps"]),
    ("0013_events_by_append.sql", &["events"]),
    (
        "0015_run_keys.sql",
        &["runs", "events", "steps", "approvals", "waits", "inbox"],
    ),
    (
        "0016_json_unchecked.sql",
        &["events", "steps", "approvals", "waits"],
    ),
];

/// Fails the migration if a row of `tables` refers to nothing.
fn check_references(tx: &rusqlite::Transaction, tables: &[&str]) -> rusqlite_migration::HookResult {
    for table in tables {
        let mut stmt = tx.prepare(&format!("PRAGMA foreign_key_check({table})"))?;
        if stmt.exists([])? {
            return Err(rusqlite_migration::HookError::Hook(format!(
                "table {table} refers to rows that do not exist"
            )));
        }
    }
    Ok(())
}

/// What a connection is for; decides which pragmas of [`pragmas`] it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The one connection that writes (also the whole database, for `:memory:`).
    Writer,
    /// The connection for inspection and the consumer's own queries.
    Reader,
    /// The lease keeper's connection: one UPDATE per renewal, outside any transaction.
    Renewal,
}

/// The pragmas applied at every open, whatever the connection. Kept apart from migrations:
/// they are per-connection settings, not schema.
fn pragmas(options: &Options, file: bool, role: Role) -> Vec<(&'static str, &'static str)> {
    let mut pragmas = vec![
        // A schema object (trigger, view, CHECK) cannot call functions with side effects.
        ("trusted_schema", "OFF"),
        ("foreign_keys", "ON"),
    ];
    if file && role == Role::Writer {
        // Readers never block the writer, and the writer never blocks readers.
        pragmas.push(("journal_mode", "WAL"));
    }
    if file && role != Role::Reader {
        // The writer checkpoints on its own schedule (between groups, once per period), not
        // inside whichever commit (a move, a renewal) takes the log past 1,000 pages.
        pragmas.push(("wal_autocheckpoint", "0"));
    }
    match role {
        Role::Writer => pragmas.push(("synchronous", options.synchronous.as_str())),
        // A renewal's commit is not synced (it is atomic all the same): a power loss that
        // undoes it only ends the lease sooner, and every holder of a lease on this file dies
        // with the machine. See `docs/lease.md`.
        Role::Renewal => pragmas.push(("synchronous", Synchronous::Normal.as_str())),
        Role::Reader => {}
    }
    if role == Role::Writer {
        // 16 MiB of page cache: the pages every move touches (the end of the events table, the
        // index pages and steps of the runs being moved) stay in memory instead of being read
        // back from the OS. With 10,000 runs at once, or a database of 120 MiB with random run
        // ids, a larger cache measured no faster, and each running run's share of it is memory.
        pragmas.push(("cache_size", "-16384"));
        // The savepoint of each move journals the pages it changes: in memory, not in a
        // temporary file written through the kernel.
        pragmas.push(("temp_store", "MEMORY"));
    }
    if role == Role::Reader {
        // Inspection and the consumer's queries cannot write behind the writer's back.
        pragmas.push(("query_only", "ON"));
    }
    pragmas
}

/// Gives a new database the settings of the file itself, which only a database with no page
/// written yet takes (so before `journal_mode`, which writes the first): `auto_vacuum =
/// INCREMENTAL`, so that a purge can give the space of what it deleted back to the disk, a
/// step at a time. Not applied at every open: on a database that has it already, setting it
/// writes a commit; on an older one, it changes nothing (`Store::vacuum` switches those).
pub(crate) fn configure_new(conn: &Connection) -> Result<()> {
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL")
        .map_err(db_error)
}

/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 128;

/// Opens a connection that writes to a database file: through the VFS that hands each commit's
/// log frames to the file in one write per 124 KiB, where there is one and it is on.
pub(crate) fn open_writing(
    path: &Path,
    flags: OpenFlags,
    options: &Options,
) -> rusqlite::Result<Connection> {
    #[cfg(unix)]
    if wal_vfs_on(options) {
        return Connection::open_with_flags_and_vfs(path, flags, super::wal_vfs::NAME);
    }
    let _ = (options, wal_vfs_on);
    Connection::open_with_flags(path, flags)
}

/// Applies the hardening and the pragmas every connection gets.
pub(crate) fn configure(
    conn: &Connection,
    options: &Options,
    file: bool,
    role: Role,
) -> Result<()> {
    (|| {
        conn.busy_timeout(options.busy_timeout)?;
        // Every statement agentrt runs stays prepared (rusqlite keeps 16 by default; the moves
        // alone use more).
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        // Defensive mode: no writes to the schema table or other ways to corrupt the file from
        // SQL.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE, true)?;
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false)?;
        Ok(())
    })()
    .map_err(db_error)?;
    for (name, value) in pragmas(options, file, role) {
        if (name, value) == ("journal_mode", "WAL") {
            enable_wal(conn)?;
            continue;
        }
        // Some answer with a row (the value set); pragma_update_and_check reads it.
        conn.pragma_update_and_check(None, name, value, |_| Ok(()))
            .or_else(|err| match err {
                rusqlite::Error::QueryReturnedNoRows => Ok(()),
                err => Err(err),
            })
            .map_err(db_error)?;
    }
    Ok(())
}

/// Puts the connection's database file in WAL mode, or fails with
/// [`Error::WalModeFailed`]. The pragma answers with the journal mode in force after it: the
/// old one when SQLite could not switch. On a file not yet in WAL mode the switch is a commit
/// of its own, which writes the file's header in rollback-journal mode; that commit's failure
/// (a failed write or sync) comes only as the statement ends, after the answer, so the
/// statement is run to its end: otherwise the failure is dropped and the store writes on in
/// rollback-journal mode.
fn enable_wal(conn: &Connection) -> Result<()> {
    let failed = |why: String| Error::WalModeFailed {
        path: conn.path().unwrap_or_default().into(),
        why,
    };
    let answered = (|| {
        let mut stmt = conn.prepare("PRAGMA journal_mode = WAL")?;
        let mut rows = stmt.query([])?;
        let mode: Option<String> = match rows.next()? {
            Some(row) => Some(row.get(0)?),
            None => None,
        };
        while rows.next()?.is_some() {}
        Ok(mode)
    })()
    .map_err(|err| failed(db_error(err).to_string()))?;
    match answered {
        Some(mode) if mode.eq_ignore_ascii_case("wal") => Ok(()),
        Some(mode) => Err(failed(format!("SQLite left it in journal mode {mode}"))),
        None => Err(failed(
            "SQLite did not say which journal mode it is in".into(),
        )),
    }
}

/// The schema version a connection's database is at.
pub(crate) fn user_version(conn: &Connection) -> rusqlite::Result<u32> {
    let found: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
    Ok(found.clamp(0, u32::MAX.into()) as u32)
}

/// Applies the migrations the database lacks.
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<()> {
    // Two processes opening a new file at once: the second waits on the write lock instead of
    // failing to upgrade a read transaction.
    conn.set_transaction_behavior(TransactionBehavior::Immediate);
    // A migration that rebuilds a table needs foreign keys off (they can only be switched
    // outside a transaction) and checks them itself before it commits; the others run with
    // them on.
    let found = user_version(conn).map_err(|err| on_open(err, path))?;
    let rebuilds = MIGRATIONS
        .iter()
        .skip(found as usize)
        .any(|(name, _)| REBUILDS.iter().any(|(file, _)| file == name));
    if rebuilds {
        conn.pragma_update(None, "foreign_keys", false)
            .map_err(db_error)?;
    }
    let result = migrations().to_latest(conn);
    if rebuilds {
        conn.pragma_update(None, "foreign_keys", true)
            .map_err(db_error)?;
    }
    conn.set_transaction_behavior(TransactionBehavior::Deferred);
    result.map_err(|err| match err {
        rusqlite_migration::Error::RusqliteError { err, .. } => on_open(err, path),
        rusqlite_migration::Error::MigrationDefinition(
            rusqlite_migration::MigrationDefinitionError::DatabaseTooFarAhead,
        ) => Error::SchemaTooNew {
            path: path.to_path_buf(),
            // Another process upgraded the file since it was checked: say what it holds now.
            found: user_version(conn).unwrap_or(0),
            supported: SCHEMA_VERSION,
        },
        other => Error::Migration(other.to_string()),
    })
}

/// Names the file when SQLite says it is not a database, or that it is damaged.
pub(crate) fn on_open(err: rusqlite::Error, path: &Path) -> Error {
    if let rusqlite::Error::SqliteFailure(failure, _) = &err {
        match failure.code {
            rusqlite::ErrorCode::NotADatabase => {
                return Error::NotADatabase {
                    path: path.to_path_buf(),
                };
            }
            rusqlite::ErrorCode::DatabaseCorrupt => {
                return Error::DatabaseCorrupt {
                    path: path.to_path_buf(),
                    detail: err.to_string(),
                };
            }
            _ => {}
        }
    }
    db_error(err)
}

/// Whether connections that write go through the log-gathering VFS.
pub(crate) fn wal_vfs_on(options: &Options) -> bool {
    #[cfg(unix)]
    {
        options.log_vfs && super::wal_vfs::register()
    }
    #[cfg(not(unix))]
    {
        let _ = options;
        false
    }
}

/// The schema version of the database file at `path`, as a store about to write it reads it:
/// without changing the file, but a log beside it is read under SQLite's locks, which creates
/// its `-shm` if missing (the writer that opens next would create it anyway). The errors of
/// [`schema_status`](super::schema_status).
pub(crate) fn schema_status(path: impl AsRef<Path>) -> Result<SchemaStatus> {
    let path = path.as_ref();
    let found = read_schema_version(path, |real| {
        read_locked(real).map_err(|err| on_open(err, path))
    })?;
    Ok(SchemaStatus {
        found,
        supported: SCHEMA_VERSION,
    })
}

/// Refuses a database of schema version `found` other than this build's: a newer one
/// ([`Error::SchemaTooNew`]), or an older one that is not to be migrated
/// ([`Error::SchemaOutdated`]).
pub(crate) fn refuse_other_schema(path: &Path, found: u32, migrating: bool) -> Result<()> {
    let (path, supported) = (path.to_path_buf(), SCHEMA_VERSION);
    if found > supported {
        return Err(Error::SchemaTooNew {
            path,
            found,
            supported,
        });
    }
    if found < supported && !migrating {
        return Err(Error::SchemaOutdated {
            path,
            found,
            supported,
        });
    }
    Ok(())
}

/// The offsets in an SQLite file's 100-byte header that the checks below read.
mod header {
    pub const MAGIC: &[u8; 16] = b"SQLite format 3\0";
    pub const PAGE_SIZE: usize = 16;
    pub const CHANGE_COUNTER: usize = 24;
    pub const PAGE_COUNT: usize = 28;
    pub const USER_VERSION: usize = 60;
    pub const VALID_FOR: usize = 92;
    pub const LEN: usize = 100;
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

/// Refuses a path (`real`, its symbolic links resolved) that names something other than a
/// regular file, found without opening it: opening a named pipe waits for a writer, which
/// would hang the open; SQLite would take a device for an empty database, and a directory or
/// a socket fails with an error that does not say what it is.
fn refuse_other_than_a_file(path: &Path, real: &Path) -> Result<()> {
    let kind = std::fs::metadata(real)
        .map_err(|err| Error::DatabaseCorrupt {
            path: path.to_path_buf(),
            detail: format!("it cannot be read: {err}"),
        })?
        .file_type();
    if kind.is_file() {
        return Ok(());
    }
    let path = path.display();
    if kind.is_dir() {
        return Err(Error::InvalidInput(format!(
            "{path} is a directory, not a database file: name the file inside it"
        )));
    }
    #[cfg(unix)]
    let what = {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            "a named pipe (FIFO)"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else {
            "a special file"
        }
    };
    #[cfg(not(unix))]
    let what = "a special file";
    Err(Error::InvalidInput(format!(
        "{path} is {what}, not a database file; it was not opened: name an SQLite database file"
    )))
}

/// The schema version of a database file, found without creating a `-wal` or `-shm` beside it
/// (SQLite's read-only connections create both for a database in WAL mode).
///
/// While a log exists beside the file, a connection may have it open, and the log may hold
/// commits that change the version: SQLite reads it then, under its locks (its side files exist
/// already, unless a crashed process left the log alone, when SQLite's recovery needs them).
/// Otherwise no connection has the database open and the file is the whole database: its
/// header says the version, and a connection that treats it as immutable (taking no lock and
/// creating nothing) reads the schema's pages to find damage. Symbolic links are resolved
/// first, as SQLite does, so that the log looked for is the one SQLite would use; a path that
/// names anything but a regular file (a directory, a named pipe, a socket, a device) is
/// refused before anything is opened.
///
/// `read_log` reads the version of a database with a log beside it, given the resolved path:
/// under SQLite's locks for a store about to write (which may create the `-shm`), or as a
/// read-only store reads (nothing created, nothing changed).
pub(crate) fn read_schema_version(
    path: &Path,
    read_log: impl FnOnce(&Path) -> Result<u32>,
) -> Result<u32> {
    use std::io::Read;

    let corrupt = |detail: String| Error::DatabaseCorrupt {
        path: path.to_path_buf(),
        detail,
    };
    let real = match std::fs::canonicalize(path) {
        Ok(real) => real,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NoDatabase {
                path: path.to_path_buf(),
            });
        }
        Err(err) => return Err(corrupt(format!("it cannot be read: {err}"))),
    };
    refuse_other_than_a_file(path, &real)?;
    let mut file =
        std::fs::File::open(&real).map_err(|err| corrupt(format!("it cannot be read: {err}")))?;
    let metadata = file
        .metadata()
        .map_err(|err| corrupt(format!("it cannot be read: {err}")))?;
    let len = metadata.len();
    if len == 0 {
        // SQLite's empty database: a file created and never written.
        return Ok(0);
    }
    let mut head = [0u8; header::LEN];
    if len < header::LEN as u64
        || file.read_exact(&mut head).is_err()
        || &head[..16] != header::MAGIC
    {
        return Err(Error::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    let mut log = real.clone().into_os_string();
    log.push("-wal");
    if Path::new(&log).exists() {
        return read_log(&real);
    }
    let page_size = match u32::from(u16::from_be_bytes([head[header::PAGE_SIZE], head[17]])) {
        1 => 65_536,
        size => size,
    };
    // The page count is valid only when written by the version that last changed the file.
    if be_u32(&head, header::VALID_FOR) == be_u32(&head, header::CHANGE_COUNTER) {
        let expected = u64::from(page_size) * u64::from(be_u32(&head, header::PAGE_COUNT));
        if len < expected {
            return Err(corrupt(format!(
                "it holds {len} bytes of the {expected} its header promises: it was cut short"
            )));
        }
    }
    let uri = format!("file:{}?immutable=1", uri_path(&real));
    let checked = rusqlite::Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .and_then(|conn| conn.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(())));
    match checked {
        Ok(()) => Ok(be_u32(&head, header::USER_VERSION)),
        // A process that opened the database since the log was looked for may have been
        // copying its log into the file (which needs the log): what looked damaged is read
        // again under SQLite's locks then. With no log still, no process wrote the file.
        Err(_) if Path::new(&log).exists() => read_log(&real),
        Err(err) => Err(on_open(err, path)),
    }
}

/// The schema version, read through SQLite's read-only connection, under its locks.
fn read_locked(path: &Path) -> rusqlite::Result<u32> {
    let conn = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(()))?;
    user_version(&conn)
}

/// `path` as the path of an SQLite URI: every byte but unreserved ASCII and `/` escaped, so
/// that any file name (non-ASCII, or not UTF-8 at all) names the same file.
pub(crate) fn uri_path(path: &Path) -> String {
    #[cfg(unix)]
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()).to_vec();
    #[cfg(not(unix))]
    let bytes = path.to_string_lossy().into_owned().into_bytes();
    let mut out = String::with_capacity(bytes.len());
    for byte in bytes {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                out.push(byte as char)
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}
