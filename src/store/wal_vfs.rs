//! A VFS over SQLite's default one that hands each commit's log frames to the file in one write.
//!
//! SQLite appends a frame to the write-ahead log with two `write` calls (its 24-byte header, then
//! the page), so a group commit of a few hundred pages costs a few hundred system calls, most of
//! the commit's time on this project's machine. This VFS gathers the consecutive writes to a log
//! file in memory and writes them with one call when the transaction's commit frame is complete,
//! or before anything else touches the file (a read, a sync, a size query, a lock, a close).
//! No reader can see the frames earlier: a commit is published (in the log's shared index, after
//! its frames are written) only once its commit frame is written, and the commit frame's page is
//! the write that sends the transaction's frames to the file, which also makes a failure of that
//! write the commit's failure. The log's format is SQLite's (frames of a 24-byte header and a
//! page; a commit frame's header holds the database's size after it), so the file on disk is
//! exactly what SQLite would have written. Every other file passes straight through.

use std::{
    ffi::{CStr, c_int, c_void},
    ptr,
    sync::OnceLock,
};

use rusqlite::ffi;

/// The name connections open the store with.
pub(crate) const NAME: &CStr = c"agentrt-wal";

/// Writes gathered for one log file before they go to the file in one call, at most.
const BUFFER_LIMIT: usize = 4 << 20;

/// The most the unix VFS writes in one call (it masks a write's length to 17 bits).
const WRITE_LIMIT: usize = 0x1f000;

/// A log frame's header: a commit frame's second field (the database's size in pages after the
/// commit) is not zero.
const FRAME_HEADER: usize = 24;

/// Registers the VFS once, and says whether it is there.
pub(crate) fn register() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        // SAFETY: the default VFS outlives the process; the VFS registered is leaked, so it
        // lives as long as SQLite may use it.
        unsafe {
            if ffi::sqlite3_initialize() != ffi::SQLITE_OK {
                return false;
            }
            let real = ffi::sqlite3_vfs_find(ptr::null());
            // The methods below assume the unix VFS's files (version 3 of the file methods).
            if real.is_null()
                || !CStr::from_ptr((*real).zName)
                    .to_bytes()
                    .starts_with(b"unix")
            {
                return false;
            }
            let mut vfs = *real;
            vfs.szOsFile = (SHIM_SIZE + (*real).szOsFile as usize) as c_int;
            vfs.pNext = ptr::null_mut();
            vfs.zName = NAME.as_ptr();
            vfs.xOpen = Some(open);
            let vfs = Box::leak(Box::new(vfs));
            REAL.set(Real(real)).ok();
            ffi::sqlite3_vfs_register(vfs, 0) == ffi::SQLITE_OK
        }
    })
}

struct Real(*mut ffi::sqlite3_vfs);
// SAFETY: SQLite's VFS objects are process-wide and thread-safe.
unsafe impl Send for Real {}
unsafe impl Sync for Real {}

static REAL: OnceLock<Real> = OnceLock::new();

/// The file SQLite holds: ours, followed in the same allocation by the default VFS's.
#[repr(C)]
struct ShimFile {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    /// Only for a write-ahead log.
    log: *mut LogBuffer,
}

/// The size of [`ShimFile`], rounded so that the real file after it is aligned.
const SHIM_SIZE: usize = std::mem::size_of::<ShimFile>().next_multiple_of(16);

#[derive(Default)]
struct LogBuffer {
    /// The file offset of `data[0]`.
    start: i64,
    data: Vec<u8>,
    /// The last write was a commit frame's header: its page completes the commit.
    commit_next: bool,
    /// A write that failed where it could not be reported (a barrier): every later call
    /// fails.
    failed: bool,
}

#[cfg(test)]
thread_local! {
    /// Writes that reached a log file from this thread.
    static LOG_WRITES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Makes this thread's next writes to a log file fail.
    static FAIL_LOG_WRITES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

unsafe extern "C" fn open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let _ = vfs;
    // SAFETY: SQLite hands us `szOsFile` bytes at `file`; the real file lives after ours.
    unsafe {
        let shim = file as *mut ShimFile;
        let real_file = (file as *mut u8).add(SHIM_SIZE) as *mut ffi::sqlite3_file;
        (*shim).base.pMethods = ptr::null();
        let real_vfs = REAL.get().expect("registered").0;
        let rc = ((*real_vfs).xOpen.expect("xOpen"))(real_vfs, name, real_file, flags, out_flags);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        (*shim).real = real_file;
        (*shim).log = if flags & ffi::SQLITE_OPEN_WAL != 0 {
            Box::into_raw(Box::default())
        } else {
            ptr::null_mut()
        };
        (*shim).base.pMethods = &METHODS;
        ffi::SQLITE_OK
    }
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};

/// The real file and its methods.
unsafe fn real(
    file: *mut ffi::sqlite3_file,
) -> (*mut ffi::sqlite3_file, &'static ffi::sqlite3_io_methods) {
    // SAFETY: only called on files this VFS opened.
    unsafe {
        let real = (*(file as *mut ShimFile)).real;
        (real, &*(*real).pMethods)
    }
}

/// Writes what the log's buffer holds, if anything.
unsafe fn flush(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: only called on files this VFS opened.
    unsafe {
        let shim = file as *mut ShimFile;
        let Some(log) = (*shim).log.as_mut() else {
            return ffi::SQLITE_OK;
        };
        if log.failed {
            return ffi::SQLITE_IOERR_WRITE;
        }
        if log.data.is_empty() {
            return ffi::SQLITE_OK;
        }
        let (real, methods) = real(file);
        let mut rc = ffi::SQLITE_OK;
        let mut offset = log.start;
        for chunk in log.data.chunks(WRITE_LIMIT) {
            #[cfg(test)]
            {
                LOG_WRITES.set(LOG_WRITES.get() + 1);
                if FAIL_LOG_WRITES.get() {
                    rc = ffi::SQLITE_IOERR_WRITE;
                    break;
                }
            }
            rc = (methods.xWrite.expect("xWrite"))(
                real,
                chunk.as_ptr() as *const c_void,
                chunk.len() as c_int,
                offset,
            );
            if rc != ffi::SQLITE_OK {
                break;
            }
            offset += chunk.len() as i64;
        }
        log.data.clear();
        rc
    }
}

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: `data` holds `amount` bytes (SQLite's contract); the file is ours.
    unsafe {
        let shim = file as *mut ShimFile;
        let Some(log) = (*shim).log.as_mut() else {
            let (real, methods) = real(file);
            return (methods.xWrite.expect("xWrite"))(real, data, amount, offset);
        };
        if log.failed {
            return ffi::SQLITE_IOERR_WRITE;
        }
        let bytes = std::slice::from_raw_parts(data as *const u8, amount as usize);
        let follows = !log.data.is_empty() && offset == log.start + log.data.len() as i64;
        if !follows || log.data.len() + bytes.len() > BUFFER_LIMIT {
            let rc = flush(file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            log.start = offset;
        }
        log.data.extend_from_slice(bytes);
        if log.commit_next && bytes.len() != FRAME_HEADER {
            // The commit frame is complete: the transaction's frames go to the file now, so
            // that a failure is the commit's.
            log.commit_next = false;
            return flush(file);
        }
        log.commit_next = bytes.len() == FRAME_HEADER && bytes[4..8] != [0; 4];
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file once; the buffer is freed with it.
    unsafe {
        let flushed = flush(file);
        let (real, methods) = real(file);
        let rc = (methods.xClose.expect("xClose"))(real);
        let shim = file as *mut ShimFile;
        if !(*shim).log.is_null() {
            drop(Box::from_raw((*shim).log));
            (*shim).log = ptr::null_mut();
        }
        if flushed != ffi::SQLITE_OK {
            flushed
        } else {
            rc
        }
    }
}

/// Flushes, then calls the real method.
macro_rules! flushed {
    ($file:ident, $method:ident $(, $arg:expr)*) => {{
        // SAFETY: the file is ours; the arguments are SQLite's own, passed on.
        unsafe {
            let rc = flush($file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            let (real, methods) = real($file);
            match methods.$method {
                Some(method) => method(real $(, $arg)*),
                None => ffi::SQLITE_IOERR,
            }
        }
    }};
}

unsafe extern "C" fn read(
    file: *mut ffi::sqlite3_file,
    data: *mut c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    flushed!(file, xRead, data, amount, offset)
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    flushed!(file, xTruncate, size)
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    flushed!(file, xSync, flags)
}

unsafe extern "C" fn file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    flushed!(file, xFileSize, size)
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    flushed!(file, xLock, level)
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    flushed!(file, xUnlock, level)
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    flushed!(file, xCheckReservedLock, out)
}

unsafe extern "C" fn file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    flushed!(file, xFileControl, op, arg)
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: the file is ours.
    unsafe {
        let (real, methods) = real(file);
        methods.xSectorSize.map_or(4096, |method| method(real))
    }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: the file is ours.
    unsafe {
        let (real, methods) = real(file);
        methods
            .xDeviceCharacteristics
            .map_or(0, |method| method(real))
    }
}

unsafe extern "C" fn shm_map(
    file: *mut ffi::sqlite3_file,
    page: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    flushed!(file, xShmMap, page, size, extend, out)
}

unsafe extern "C" fn shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    flushed!(file, xShmLock, offset, n, flags)
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: the file is ours.
    unsafe {
        // SQLite calls it on the database file, whose writes are not gathered; were it called
        // on a log with writes pending, a failure could not be returned, so every later call
        // on the file fails instead.
        if flush(file) != ffi::SQLITE_OK
            && let Some(log) = (*(file as *mut ShimFile)).log.as_mut()
        {
            log.failed = true;
        }
        let (real, methods) = real(file);
        if let Some(method) = methods.xShmBarrier {
            method(real);
        }
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    flushed!(file, xShmUnmap, delete)
}

unsafe extern "C" fn fetch(
    file: *mut ffi::sqlite3_file,
    offset: i64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    flushed!(file, xFetch, offset, amount, out)
}

unsafe extern "C" fn unfetch(
    file: *mut ffi::sqlite3_file,
    offset: i64,
    page: *mut c_void,
) -> c_int {
    flushed!(file, xUnfetch, offset, page)
}

#[cfg(test)]
mod tests {
    use rusqlite::{Connection, OpenFlags};

    use super::*;

    fn open(path: &std::path::Path, synchronous: &str) -> Connection {
        assert!(register());
        let conn = Connection::open_with_flags_and_vfs(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            NAME,
        )
        .unwrap();
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = {synchronous};
             CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT NOT NULL);"
        ))
        .unwrap();
        conn
    }

    /// Writes `rows` rows of 300 bytes in one transaction: about one page per ten rows.
    fn commit_rows(conn: &Connection, from: i64, rows: i64) -> rusqlite::Result<()> {
        let tx = conn.unchecked_transaction()?;
        for k in from..from + rows {
            tx.execute(
                "INSERT OR REPLACE INTO t (k, v) VALUES (?1, ?2)",
                rusqlite::params![k, "x".repeat(300)],
            )?;
        }
        tx.commit()
    }

    fn count(conn: &Connection) -> i64 {
        conn.query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn every_commit_through_the_vfs_is_read_back_by_a_connection_of_the_default_vfs() {
        // At NORMAL no sync follows the frames: the commit frame alone must send them.
        for synchronous in ["FULL", "NORMAL"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            let writer = open(&path, synchronous);
            let reader = Connection::open(&path).unwrap();
            for round in 0..200i64 {
                // Small and large transactions, some past the buffer's limit, some
                // overwriting rows (and pages) of earlier ones.
                let rows = [0, 1, 40, 400, 20_000][round as usize % 5];
                commit_rows(&writer, round * 37, rows).unwrap();
                assert_eq!(
                    count(&reader),
                    count(&writer),
                    "{synchronous}, round {round}"
                );
                if round % 50 == 49 {
                    writer
                        .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
                        .unwrap();
                }
            }
            let check: String = reader
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap();
            assert_eq!(check, "ok");
        }
    }

    #[test]
    fn a_commit_reaches_the_log_in_one_write_per_124_kib_not_two_per_page() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open(&dir.path().join("db"), "NORMAL");
        commit_rows(&writer, 0, 10).unwrap();
        let before = LOG_WRITES.get();
        // About 60 pages: 120 writes through the default VFS.
        commit_rows(&writer, 1000, 600).unwrap();
        let writes = LOG_WRITES.get() - before;
        assert!((1..=3).contains(&writes), "{writes} writes");
    }

    #[test]
    fn a_failed_log_write_fails_its_commit_and_the_database_goes_on_from_the_last_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let writer = open(&path, "FULL");
        let reader = Connection::open(&path).unwrap();
        commit_rows(&writer, 0, 100).unwrap();
        FAIL_LOG_WRITES.set(true);
        let failed = commit_rows(&writer, 100, 100);
        FAIL_LOG_WRITES.set(false);
        let err = failed.unwrap_err();
        assert_eq!(
            err.sqlite_error_code(),
            Some(rusqlite::ErrorCode::SystemIoFailure),
            "{err}"
        );
        assert!(writer.is_autocommit(), "the transaction was rolled back");
        assert_eq!(count(&reader), 100);
        assert_eq!(count(&writer), 100);
        commit_rows(&writer, 100, 100).unwrap();
        assert_eq!(count(&reader), 200);
        drop(writer);
        drop(reader);
        let reopened = Connection::open(&path).unwrap();
        assert_eq!(count(&reopened), 200);
    }
}
