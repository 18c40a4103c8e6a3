//! A VFS over SQLite's default one that hands each commit's log frames to the file in one write.
//!
//! SQLite appends a frame to the write-ahead log with two `write` calls (its 24-byte header, then
//! the page), so a group commit of a few hundred pages costs twice as many system calls (what
//! that costs is in `docs/performance.md`). This VFS gathers the consecutive writes to a log
//! file in memory and writes them with one call per [`WRITE_LIMIT`] bytes:
//!
//! - when the page of a commit frame (the frame whose header holds the database's size after the
//!   transaction) is written: the transaction's frames reach the file inside that write, so a
//!   failure is the commit's failure, which SQLite rolls back. What the transaction writes after
//!   it (checksums rewritten in place, padding to a sector, the rest of a write split at a sync)
//!   goes to the file at once, in the write that carries it, until the write lock is released;
//! - before anything else is done with the log (a read, a sync, a size query, a close);
//! - before the database file's shared-index barrier, which SQLite passes between writing a
//!   commit's frames and publishing the commit to other connections: no connection can read a
//!   published commit whose frames are not in the file, whatever path wrote them (should a
//!   commit be written in a way this VFS does not recognise);
//! - before any change of the database's shared-index locks, among them the release of the
//!   write lock: frames of a transaction rolled back never outlive it, to land on frames another
//!   connection wrote since.
//!
//! A gathered write that fails drops what it held, and the call that wrote it (the commit
//! frame's page, a read, a sync, a size query, a lock taken) returns its error. SQLite ignores
//! some of those errors (a size query's), so until the write lock is released every later
//! write, read and sync of that log fails too: a transaction that lost frames cannot commit.
//! Only the barrier cannot report an error: a write that fails there aborts the process rather
//! than let a commit be published whose frames are not in the file. The SQLite releases of
//! [`SUPPORTED`] never leave bytes to write there (the commit frame's page sent them, and what
//! follows it goes at once); it is the guard for a write pattern this VFS does not know, and
//! other releases do not get the VFS at all.
//!
//! The bytes, their offsets and their order are SQLite's own, so the file is exactly what SQLite
//! would have written, but for one thing: a log that starts (or starts over) in a file shorter
//! than [`PREALLOCATED_LOG`] is first extended to that size with zeros, written past the file's
//! end, so that its frames rewrite the file in place instead of growing it (see
//! [`preallocate`]). Files other than a log pass straight through, and so does a log whose
//! database file was not opened through this VFS. It assumes the log's shared index lives in
//! shared memory (not `locking_mode=EXCLUSIVE`, which agentrt never sets): that is where the
//! barrier and the locks are passed.

use std::{
    ffi::{CStr, c_int, c_void},
    ptr,
    sync::OnceLock,
};

use rusqlite::ffi;

/// The name connections open the store with.
pub(crate) const NAME: &CStr = c"agentrt-wal";

/// Writes gathered for one log file before they go to the file, at most.
const BUFFER_LIMIT: usize = 4 << 20;

/// The most the unix VFS writes in one call (it masks a write's length to 17 bits).
const WRITE_LIMIT: usize = 0x1f000;

/// The size a log is extended to, with zeros, when it starts (or starts over) in a shorter
/// file: about what one busy run's log reaches between two of the writer's checkpoints (8 MiB
/// holds some 2,000 frames of 4 KiB pages). Larger logs keep their size, as SQLite leaves them.
const PREALLOCATED_LOG: i64 = 8 << 20;

/// A log frame's header: a commit frame's second field (the database's size in pages after the
/// commit) is not zero.
const FRAME_HEADER: usize = 24;

/// The SQLite versions this VFS was written for and checked against: 3.53.x, the release that
/// rusqlite 0.40's `bundled` feature builds.
///
/// SQLite's VFS contract says nothing of the order or the size of a log's writes, and this VFS
/// relies on both, as SQLite 3.53 makes them: each frame written as two calls (its 24-byte
/// header, then its page), the commit frame told by its header, nothing of a commit left to
/// write once its commit frame's page is written except in-place rewrites, padding and the
/// remainder of a write split at a sync, and the shared-index barrier passed between writing
/// a commit's frames and publishing it, under the write lock (the shared-index lock at offset
/// 0). Another release may write its log otherwise: it gets SQLite's default VFS until its
/// log writes are checked again and this range widened.
const SUPPORTED: std::ops::Range<c_int> = 3_053_000..3_054_000;

/// Whether the SQLite of `version` (as `sqlite3_libversion_number` gives it: 3.53.2 is
/// 3053002) is one this VFS was written for.
pub(crate) fn supported(version: c_int) -> bool {
    SUPPORTED.contains(&version)
}

/// Registers the VFS once, and says whether it is there. Refused (with a warning, once) when
/// the running SQLite is not one it was written for, or its default VFS not the unix one:
/// connections then use SQLite's default VFS.
pub(crate) fn register() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let version = rusqlite::version_number();
        if !supported(version) {
            tracing::warn!(
                sqlite = rusqlite::version(),
                "the log-gathering VFS was not written for this SQLite: connections use \
                 SQLite's default VFS"
            );
            return false;
        }
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
                tracing::warn!(
                    "SQLite's default VFS is not the unix one: connections use it, without \
                     the log-gathering VFS"
                );
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
    /// Only for a log whose database file is ours.
    log: *mut LogBuffer,
    /// A log: its database file. A database file: its log, while both are open. Cleared by
    /// whichever closes first.
    peer: *mut ShimFile,
    /// The test seam: this store's counted and failed writes, syncs and truncations.
    #[cfg(any(test, feature = "testkit"))]
    seam: super::faults::vfs::FileSeam,
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
    /// A commit frame's page was written since the write lock was taken: every write goes to
    /// the file at once, so that its failure is the commit's.
    through: bool,
    /// The end of the furthest write since the log last started over (a write at offset 0).
    end: i64,
    /// A write failed (and its bytes were dropped) since the write lock was last taken or
    /// released: the log's writes, reads and syncs fail until it is released, and the barrier
    /// must not let a commit be published (SQLite ignores some errors, of a size query, say).
    failed: bool,
    /// An extension of the file failed (see [`preallocate`]): not tried again on this file.
    extension_failed: bool,
}

unsafe extern "C" fn open(
    _: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite hands us `szOsFile` bytes at `file`; the real file lives after ours. On
    // failure the real VFS leaves its file closed, and ours has no methods: nothing to close.
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
        (*shim).log = ptr::null_mut();
        (*shim).peer = ptr::null_mut();
        // Written in place: the memory is SQLite's, not yet a value to drop.
        #[cfg(any(test, feature = "testkit"))]
        ptr::addr_of_mut!((*shim).seam).write(super::faults::vfs::FileSeam::new(name, flags));
        (*shim).base.pMethods = &METHODS;
        if flags & ffi::SQLITE_OPEN_WAL != 0 {
            // Gathered only when the database file is ours: its barrier and locks are where
            // the buffer is written before a commit is published or the write lock released.
            // SQLite closes a database's log before it opens another: a database already
            // linked is not expected, and its log is left to pass through.
            let db = ffi::sqlite3_database_file_object(name) as *mut ShimFile;
            if !db.is_null() && ptr::eq((*db).base.pMethods, &METHODS) && (*db).peer.is_null() {
                (*shim).log = Box::into_raw(Box::default());
                (*shim).peer = db;
                (*db).peer = shim;
            }
        }
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
    // SAFETY: only called on files this VFS opened, whose real file is open.
    unsafe {
        let real = (*(file as *mut ShimFile)).real;
        (real, &*(*real).pMethods)
    }
}

/// Writes what a log's buffer holds, if anything. The buffer is empty afterwards, written or
/// not.
unsafe fn flush(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: only called on files this VFS opened.
    unsafe {
        match (*(file as *mut ShimFile)).log.as_mut() {
            Some(log) => write_out(file, log),
            None => ffi::SQLITE_OK,
        }
    }
}

/// Writes what `log` (the buffer of `file`, borrowed once by the caller) holds, if anything.
unsafe fn write_out(file: *mut ffi::sqlite3_file, log: &mut LogBuffer) -> c_int {
    // SAFETY: only called on files this VFS opened.
    unsafe {
        if log.data.is_empty() {
            return ffi::SQLITE_OK;
        }
        let (real, methods) = real(file);
        let mut rc = ffi::SQLITE_OK;
        let mut offset = log.start;
        for chunk in log.data.chunks(WRITE_LIMIT) {
            #[cfg(any(test, feature = "testkit"))]
            if super::faults::vfs::before_log_write()
                || (*(file as *mut ShimFile))
                    .seam
                    .fails(super::faults::vfs::Op::Write)
            {
                rc = ffi::SQLITE_IOERR_WRITE;
                break;
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
        log.commit_next = false;
        log.failed |= rc != ffi::SQLITE_OK;
        rc
    }
}

/// `SQLITE_IOERR_WRITE` for a log one of whose gathered writes failed since the write lock was
/// taken: the transaction cannot commit, nor read back the frames dropped.
unsafe fn refused(file: *mut ffi::sqlite3_file) -> Option<c_int> {
    // SAFETY: only called on files this VFS opened.
    unsafe {
        (*(file as *mut ShimFile))
            .log
            .as_ref()
            .filter(|log| log.failed)
            .map(|_| ffi::SQLITE_IOERR_WRITE)
    }
}

/// For a database file: its log and the log's buffer, if it has a log of ours.
unsafe fn log_of<'a>(
    db: *mut ffi::sqlite3_file,
) -> Option<(*mut ffi::sqlite3_file, &'a mut LogBuffer)> {
    // SAFETY: the file is ours; a peer is cleared before it is freed.
    unsafe {
        let shim = db as *mut ShimFile;
        let log = (*shim).peer;
        if !(*shim).log.is_null() || log.is_null() {
            return None;
        }
        (*log)
            .log
            .as_mut()
            .map(|buffer| (log as *mut ffi::sqlite3_file, buffer))
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
            #[cfg(any(test, feature = "testkit"))]
            if (*shim).seam.fails(super::faults::vfs::Op::Write) {
                return ffi::SQLITE_IOERR_WRITE;
            }
            let (real, methods) = real(file);
            return (methods.xWrite.expect("xWrite"))(real, data, amount, offset);
        };
        if log.failed {
            return ffi::SQLITE_IOERR_WRITE;
        }
        let bytes = std::slice::from_raw_parts(data as *const u8, amount as usize);
        let completes_commit = log.commit_next && bytes.len() != FRAME_HEADER;
        let commit_header = bytes.len() == FRAME_HEADER && bytes[4..8] != [0; 4];
        if offset == 0 {
            log.end = 0;
            // The log's header: the log starts, or starts over.
            let rc = write_out(file, log);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            preallocate(file, log);
        }
        let rewrites = offset < log.end;
        log.end = log.end.max(offset + bytes.len() as i64);
        let follows = !log.data.is_empty() && offset == log.start + log.data.len() as i64;
        if !follows || log.data.len() + bytes.len() > BUFFER_LIMIT {
            let rc = write_out(file, log);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            log.start = offset;
        }
        log.data.extend_from_slice(bytes);
        // The commit frame is complete: the transaction's frames go to the file now, so that
        // a failure is the commit's; and so does everything the transaction writes after it.
        if completes_commit || log.through {
            log.through = true;
            return write_out(file, log);
        }
        let mut rc = ffi::SQLITE_OK;
        if commit_header && rewrites {
            // A commit frame's header below the log's end: its checksum rewritten in place
            // (after pages rewritten within the transaction), with no page after it; or, when
            // another connection started the log over, a new commit frame, whose page follows.
            rc = write_out(file, log);
        }
        log.commit_next = commit_header;
        rc
    }
}

/// Zeros, written past a log's end to extend it.
static ZEROS: [u8; WRITE_LIMIT] = [0; WRITE_LIMIT];

/// Extends the log `file` with zeros to [`PREALLOCATED_LOG`] bytes, if it is shorter, as SQLite
/// is about to write its header: the log's frames then rewrite the file in place, and a commit's
/// sync no longer also commits a change of the file's size (which costs about half as much
/// again as the sync alone on ext4).
///
/// SQLite writes the header (at offset 0) only as the log starts or starts over, holding the
/// write lock, when no reader needs a frame of the file; the buffer is empty here, so the
/// file's end is past every frame written, and the zeros go past it only: no byte of the file
/// is rewritten. A frame of zeros (page number 0, salts other than the header's) is where
/// SQLite's recovery finds the log's end, as in a log started over on an older one's frames.
/// SQLite syncs the header before it writes a frame (unless `synchronous = OFF`), and that
/// sync carries the zeros.
///
/// A failed extension (a full disk) fails nothing: the file is cut back to its size (which
/// frees what was written; failing that, zeros past the end are harmless), the commit goes
/// on as it would have, and the file is not extended again. A write-back of the zeros that
/// fails later fails the next sync of the log, as any lost write of the log does.
unsafe fn preallocate(file: *mut ffi::sqlite3_file, log: &mut LogBuffer) {
    if log.extension_failed {
        return;
    }
    // SAFETY: the file is ours.
    unsafe {
        let (real, methods) = real(file);
        let mut size = 0;
        if (methods.xFileSize.expect("xFileSize"))(real, &mut size) != ffi::SQLITE_OK
            || size >= PREALLOCATED_LOG
        {
            return;
        }
        let rc = write_zeros(real, methods, size, PREALLOCATED_LOG);
        if rc != ffi::SQLITE_OK {
            log.extension_failed = true;
            let _ = (methods.xTruncate.expect("xTruncate"))(real, size);
            tracing::warn!(
                rc,
                "the write-ahead log could not be extended ahead of its frames"
            );
        }
    }
}

/// Writes zeros from `from` to `to` in the real file.
unsafe fn write_zeros(
    real: *mut ffi::sqlite3_file,
    methods: &ffi::sqlite3_io_methods,
    from: i64,
    to: i64,
) -> c_int {
    #[cfg(any(test, feature = "testkit"))]
    let fail = super::faults::vfs::before_extension(from, to);
    let mut at = from;
    while at < to {
        #[cfg(any(test, feature = "testkit"))]
        if fail && at >= from + (to - from) / 2 {
            // As a full disk would: halfway.
            return ffi::SQLITE_FULL;
        }
        let amount = (to - at).min(WRITE_LIMIT as i64) as c_int;
        // SAFETY: the real file is open; ZEROS holds `amount` bytes.
        let rc =
            unsafe { (methods.xWrite.expect("xWrite"))(real, ZEROS.as_ptr().cast(), amount, at) };
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        at += i64::from(amount);
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file once; its buffer is freed with it, and its peer forgets it.
    unsafe {
        let flushed = flush(file);
        let (real, methods) = real(file);
        let rc = (methods.xClose.expect("xClose"))(real);
        let shim = file as *mut ShimFile;
        let peer = (*shim).peer;
        if !peer.is_null() && ptr::eq((*peer).peer, shim) {
            (*peer).peer = ptr::null_mut();
        }
        (*shim).peer = ptr::null_mut();
        if !(*shim).log.is_null() {
            drop(Box::from_raw((*shim).log));
            (*shim).log = ptr::null_mut();
        }
        #[cfg(any(test, feature = "testkit"))]
        drop(ptr::addr_of!((*shim).seam).read());
        if flushed != ffi::SQLITE_OK {
            flushed
        } else {
            rc
        }
    }
}

/// Writes the file's own buffer, then calls the real method.
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
    if let Some(rc) = unsafe { refused(file) } {
        return rc;
    }
    flushed!(file, xRead, data, amount, offset)
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    // SAFETY: the file is ours.
    #[cfg(any(test, feature = "testkit"))]
    if unsafe {
        (*(file as *mut ShimFile))
            .seam
            .fails(super::faults::vfs::Op::Truncate)
    } {
        return ffi::SQLITE_IOERR_TRUNCATE;
    }
    flushed!(file, xTruncate, size)
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    if let Some(rc) = unsafe { refused(file) } {
        return rc;
    }
    let rc = flushed!(file, xSync, flags);
    // A failed write-back is reported after the sync: what it was to write may be on disk.
    // SAFETY: the file is ours.
    #[cfg(any(test, feature = "testkit"))]
    if rc == ffi::SQLITE_OK
        && unsafe {
            (*(file as *mut ShimFile))
                .seam
                .fails(super::faults::vfs::Op::Sync)
        }
    {
        return ffi::SQLITE_IOERR_FSYNC;
    }
    rc
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
    // SAFETY: the file is ours. What the log still holds here was never published (a commit's
    // frames went at its commit frame, or at the barrier): frames of a transaction rolled back,
    // or spilled before a failure. They are written as SQLite would have written them, while
    // this connection still holds the write lock. If that fails they are dropped (`write_out`
    // empties the buffer either way): the lock asked for is refused with the error, which
    // SQLite reports (a release cannot fail: its frames were never published, and the next
    // writer writes over them). Taking or releasing the write lock (offset 0 of the shared
    // index's locks) starts a transaction afresh: a failure before it no longer concerns it.
    unsafe {
        if let Some((log, buffer)) = log_of(file) {
            let rc = write_out(log, buffer);
            if rc != ffi::SQLITE_OK && flags & ffi::SQLITE_SHM_LOCK != 0 {
                return rc;
            }
            if offset == 0 && flags & ffi::SQLITE_SHM_EXCLUSIVE != 0 {
                buffer.failed = false;
                buffer.through = false;
            }
        }
    }
    flushed!(file, xShmLock, offset, n, flags)
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: the file is ours.
    unsafe {
        // SQLite passes the barrier between writing a commit's frames and publishing it: the
        // frames must be in the file first. The barrier cannot fail (`xShmBarrier` returns
        // nothing, and SQLite publishes the commit right after it), so neither may this: a
        // process that cannot write a commit it is about to publish stops here, and the next
        // to open the database recovers the log from the file, without that commit. A failure
        // since the write lock was taken failed every later write, the commit frame's among
        // them, so no commit gets here after one; and SQLite 3.53 leaves nothing to write here
        // (see the module's documentation).
        if let Some((log, buffer)) = log_of(file) {
            #[cfg(any(test, feature = "testkit"))]
            super::faults::vfs::at_barrier(!buffer.data.is_empty() || buffer.failed);
            // A failed write marks the buffer failed.
            let _ = write_out(log, buffer);
            if buffer.failed {
                tracing::error!(
                    "a commit's log frames could not be written before its publication"
                );
                std::process::abort();
            }
        }
        let (real, methods) = real(file);
        if let Some(method) = methods.xShmBarrier {
            method(real);
        }
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: the file is ours.
    if let Some((log, buffer)) = unsafe { log_of(file) } {
        let _ = unsafe { write_out(log, buffer) };
    }
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
    use crate::store::sqlite::faults::vfs;

    fn open(path: &std::path::Path, synchronous: &str) -> Connection {
        open_as(path, synchronous, true)
    }

    /// `psow`: whether the file is taken to be safe from overwrites at a power loss (SQLite's
    /// default). If not, a commit at `FULL` pads the log to the end of a sector with copies of
    /// its commit frame, and splits the write that crosses the sector's end at a sync.
    fn open_as(path: &std::path::Path, synchronous: &str, psow: bool) -> Connection {
        assert!(register());
        let conn = Connection::open_with_flags_and_vfs(
            format!("file:{}?psow={}", path.display(), u8::from(psow)),
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_URI,
            NAME,
        )
        .unwrap();
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = {synchronous};
             PRAGMA wal_autocheckpoint = 0;
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
    fn only_the_sqlite_it_was_written_for_gets_the_vfs() {
        // The SQLite this crate is built with is one of them.
        assert!(
            supported(rusqlite::version_number()),
            "{}",
            rusqlite::version()
        );
        assert!(register());
        for version in [3_053_000, 3_053_002, 3_053_999] {
            assert!(supported(version), "{version}");
        }
        for version in [3_052_999, 3_054_000, 3_045_001, 4_053_000, 0, -1] {
            assert!(!supported(version), "{version}");
        }
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
        let before = vfs::log_writes();
        // About 60 pages: 120 writes through the default VFS.
        commit_rows(&writer, 1000, 600).unwrap();
        let writes = vfs::log_writes() - before;
        assert!((1..=3).contains(&writes), "{writes} writes");
    }

    #[test]
    fn a_failed_log_write_fails_its_commit_and_the_database_goes_on_from_the_last_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let writer = open(&path, "FULL");
        let reader = Connection::open(&path).unwrap();
        commit_rows(&writer, 0, 100).unwrap();
        vfs::fail_log_writes(true);
        let failed = commit_rows(&writer, 100, 100);
        vfs::fail_log_writes(false);
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

    /// The database and its log as a process that died now would leave them (without the
    /// shared index, so that whoever opens the copy recovers the log from the file alone).
    fn crash_image(path: &std::path::Path) -> (tempfile::TempDir, Connection) {
        let copy = tempfile::tempdir().unwrap();
        let copied = copy.path().join("db");
        std::fs::copy(path, &copied).unwrap();
        let wal = std::path::PathBuf::from(format!("{}-wal", path.display()));
        std::fs::copy(&wal, format!("{}-wal", copied.display())).unwrap();
        let conn = Connection::open(&copied).unwrap();
        let check: String = conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(check, "ok");
        (copy, conn)
    }

    #[test]
    fn a_transaction_that_spills_pages_to_the_log_is_whole_in_the_file_once_it_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let writer = open(&path, "NORMAL");
        // A cache of 20 pages: the transaction writes frames before its commit, and rewrites
        // some of them (and their checksums) in place.
        writer.execute_batch("PRAGMA cache_size = 20").unwrap();
        commit_rows(&writer, 0, 20_000).unwrap();
        commit_rows(&writer, 5_000, 20_000).unwrap();
        // Nothing more on the writer: what recovery finds is what the commits left.
        let (_copy, recovered) = crash_image(&path);
        assert_eq!(count(&recovered), 25_000);
    }

    #[test]
    fn frames_of_a_rolled_back_transaction_never_land_on_another_connections_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let writer = open(&path, "NORMAL");
        writer.execute_batch("PRAGMA cache_size = 20").unwrap();
        commit_rows(&writer, 0, 100).unwrap();
        {
            // Spills frames, then rolls back.
            let tx = writer.unchecked_transaction().unwrap();
            for k in 1_000..21_000 {
                tx.execute(
                    "INSERT INTO t (k, v) VALUES (?1, ?2)",
                    rusqlite::params![k, "y".repeat(300)],
                )
                .unwrap();
            }
            tx.rollback().unwrap();
        }
        // Another connection writes where the rolled-back frames were. (The rollback's own
        // reads of the log may write them before the write lock's release does: either way,
        // before the lock is released.)
        let other = Connection::open(&path).unwrap();
        commit_rows(&other, 100, 2_000).unwrap();
        // The writer goes on: anything it still held of the rolled-back transaction would be
        // written now.
        commit_rows(&writer, 50_000, 1).unwrap();
        assert_eq!(count(&writer), 2_101);
        let (_copy, recovered) = crash_image(&path);
        assert_eq!(count(&recovered), 2_101);
    }

    /// Writes `rows` rows of about a page each, in one transaction.
    fn commit_pages(conn: &Connection, from: i64, rows: i64) -> rusqlite::Result<()> {
        let tx = conn.unchecked_transaction()?;
        for k in from..from + rows {
            tx.execute(
                "INSERT OR REPLACE INTO t (k, v) VALUES (?1, ?2)",
                rusqlite::params![k, "p".repeat(3_900)],
            )?;
        }
        tx.commit()
    }

    #[test]
    fn no_commit_reaches_its_publication_with_bytes_still_to_write() {
        // Around the buffer's limit (of 4 KiB pages, the 1,018th frame is the last to fit whole
        // and only the header of the 1,019th fits), and a transaction that spills and rewrites
        // checksums in place.
        for rows in 1000..1030 {
            let dir = tempfile::tempdir().unwrap();
            let writer = open(&dir.path().join("db"), "NORMAL");
            vfs::take_barrier_found_bytes();
            commit_pages(&writer, 0, rows).unwrap();
            assert!(!vfs::take_barrier_found_bytes(), "{rows} rows");
        }
        let dir = tempfile::tempdir().unwrap();
        let writer = open(&dir.path().join("db"), "NORMAL");
        writer.execute_batch("PRAGMA cache_size = 20").unwrap();
        vfs::take_barrier_found_bytes();
        commit_rows(&writer, 0, 20_000).unwrap();
        commit_rows(&writer, 5_000, 20_000).unwrap();
        assert!(!vfs::take_barrier_found_bytes(), "a spilled transaction");
        // Another connection starts the log over: this one's idea of the log's end is past
        // its next frames, whose commit headers look like rewrites.
        writer
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
            .unwrap();
        let other = Connection::open(dir.path().join("db")).unwrap();
        commit_rows(&other, 0, 1).unwrap();
        for round in 0..20 {
            commit_rows(&writer, round * 10, 10).unwrap();
            assert!(
                !vfs::take_barrier_found_bytes(),
                "after a restart by another, round {round}"
            );
        }
        // Commits padded to a sector, whose last write is split at a sync: what follows the
        // commit frame goes at once.
        let dir = tempfile::tempdir().unwrap();
        let writer = open_as(&dir.path().join("db"), "FULL", false);
        vfs::take_barrier_found_bytes();
        for rows in [1, 10, 100, 1_000] {
            commit_rows(&writer, rows, rows).unwrap();
            assert!(!vfs::take_barrier_found_bytes(), "padded, {rows} rows");
        }
    }

    #[test]
    fn a_write_that_fails_anywhere_in_a_commit_fails_it_or_leaves_it_whole() {
        // Each write of a spilled transaction, and of one padded to a sector, fails in turn;
        // none may reach the barrier (which would abort the process).
        for (synchronous, psow) in [("NORMAL", true), ("FULL", false)] {
            a_write_that_fails_anywhere_fails_the_commit_or_leaves_it_whole(synchronous, psow);
        }
    }

    fn a_write_that_fails_anywhere_fails_the_commit_or_leaves_it_whole(
        synchronous: &str,
        psow: bool,
    ) {
        // The writes the transaction makes, when `fail_at` is `None`.
        let writes_of = |fail_at: Option<usize>| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            let writer = open_as(&path, synchronous, psow);
            writer.execute_batch("PRAGMA cache_size = 20").unwrap();
            commit_rows(&writer, 0, 500).unwrap();
            let before = vfs::log_writes();
            vfs::fail_log_write_at(fail_at.map(|k| before + k));
            vfs::take_barrier_found_bytes();
            let result = commit_rows(&writer, 200, 3_000);
            vfs::fail_log_write_at(None);
            let writes = vfs::log_writes() - before;
            assert!(
                !vfs::take_barrier_found_bytes(),
                "failing write {fail_at:?}"
            );
            let expected = if result.is_ok() { 3_200 } else { 500 };
            assert_eq!(count(&writer), expected, "failing write {fail_at:?}");
            let (_copy, recovered) = crash_image(&path);
            let recovered = count(&recovered);
            // A padding frame that fails after the commit frame reached the file fails the
            // commit, which recovery from the file alone finds whole: as with SQLite's own
            // writes.
            assert!(
                recovered == expected || (!psow && result.is_err() && recovered == 3_200),
                "failing write {fail_at:?}: {recovered} rows recovered"
            );
            writes
        };
        let writes = writes_of(None);
        assert!(writes > 3, "{writes} writes");
        for k in 1..=writes {
            writes_of(Some(k));
        }
    }

    /// The log file of a connection's main database.
    fn log_file(conn: &Connection) -> *mut ffi::sqlite3_file {
        let mut log: *mut ffi::sqlite3_file = ptr::null_mut();
        // SAFETY: the handle is open; SQLITE_FCNTL_JOURNAL_POINTER writes its log's file.
        let rc = unsafe {
            ffi::sqlite3_file_control(
                conn.handle(),
                c"main".as_ptr(),
                ffi::SQLITE_FCNTL_JOURNAL_POINTER,
                (&mut log as *mut *mut ffi::sqlite3_file).cast(),
            )
        };
        assert_eq!(rc, ffi::SQLITE_OK);
        assert!(!log.is_null());
        log
    }

    #[test]
    fn a_failed_write_whose_error_sqlite_ignores_still_fails_the_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let writer = open(&path, "NORMAL");
        writer.execute_batch("PRAGMA cache_size = 20").unwrap();
        commit_rows(&writer, 0, 100).unwrap();
        let tx = writer.unchecked_transaction().unwrap();
        // Spills frames until some are still gathered, then asks for the log's size as SQLite
        // does when it limits the log (which ignores the error): the gathered write fails.
        let mut k = 1_000;
        loop {
            for k in k..k + 100 {
                tx.execute(
                    "INSERT INTO t (k, v) VALUES (?1, ?2)",
                    rusqlite::params![k, "s".repeat(300)],
                )
                .unwrap();
            }
            k += 100;
            let log = log_file(&tx);
            let before = vfs::log_writes();
            vfs::fail_log_writes(true);
            let mut size = 0;
            // SAFETY: the log is open, and ours.
            let rc = unsafe { file_size(log, &mut size) };
            vfs::fail_log_writes(false);
            if vfs::log_writes() > before {
                assert_eq!(rc, ffi::SQLITE_IOERR_WRITE);
                break;
            }
            assert!(k < 50_000, "nothing was ever left gathered");
        }
        // The frames dropped cannot be read back, nor the transaction committed.
        vfs::take_barrier_found_bytes();
        let err = tx.commit().unwrap_err();
        assert!(!vfs::take_barrier_found_bytes());
        assert_eq!(
            err.sqlite_error_code(),
            Some(rusqlite::ErrorCode::SystemIoFailure),
            "{err}"
        );
        if !writer.is_autocommit() {
            writer.execute_batch("ROLLBACK").unwrap();
        }
        assert_eq!(count(&writer), 100);
        // The write lock released, the log is written again.
        commit_rows(&writer, 100, 100).unwrap();
        assert_eq!(count(&writer), 200);
        let (_copy, recovered) = crash_image(&path);
        assert_eq!(count(&recovered), 200);
    }

    fn log_len(path: &std::path::Path) -> i64 {
        std::fs::metadata(format!("{}-wal", path.display())).map_or(0, |m| m.len() as i64)
    }

    #[test]
    fn the_log_is_extended_once_when_it_starts_and_never_below_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        vfs::take_extensions();
        let writer = open(&path, "FULL");
        // The log's first header: the new file is extended from nothing.
        assert_eq!(vfs::take_extensions(), [(0, PREALLOCATED_LOG)]);
        assert_eq!(log_len(&path), PREALLOCATED_LOG);
        for round in 0..20 {
            commit_rows(&writer, round * 100, 100).unwrap();
        }
        writer
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
            .unwrap();
        commit_rows(&writer, 0, 1).unwrap();
        // Started over in a file long enough: nothing written past its end, nor a size change.
        assert!(vfs::take_extensions().is_empty());
        assert_eq!(log_len(&path), PREALLOCATED_LOG);
        // Grown past the extension by commits, it keeps their size.
        commit_rows(&writer, 0, 40_000).unwrap();
        let grown = log_len(&path);
        assert!(grown > PREALLOCATED_LOG, "{grown}");
        writer
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
            .unwrap();
        commit_rows(&writer, 0, 1).unwrap();
        assert!(vfs::take_extensions().is_empty());
        assert_eq!(log_len(&path), grown);
        // A log of another VFS's connection, shorter and holding frames: extended past its end
        // only, when this VFS's connection starts it over.
        writer
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        let other = Connection::open(&path).unwrap();
        commit_rows(&other, 0, 100).unwrap();
        other
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
            .unwrap();
        let before = log_len(&path);
        assert!((1..PREALLOCATED_LOG).contains(&before), "{before}");
        commit_rows(&writer, 100, 1).unwrap();
        assert_eq!(vfs::take_extensions(), [(before, PREALLOCATED_LOG)]);
        assert_eq!(log_len(&path), PREALLOCATED_LOG);
        assert_eq!(count(&other), 40_000);
    }

    #[test]
    fn a_crash_image_of_a_preallocated_log_recovers_every_commit() {
        for synchronous in ["FULL", "NORMAL"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            let writer = open(&path, synchronous);
            let mut rows = 0;
            for round in 0..24i64 {
                // Within the extension, past it, and after the log started over on frames
                // of an earlier pass.
                let add = [1, 40, 400, 12_000][round as usize % 4];
                commit_rows(&writer, rows, add).unwrap();
                rows += add;
                let (_copy, recovered) = crash_image(&path);
                assert_eq!(count(&recovered), rows, "{synchronous}, round {round}");
                if round == 11 {
                    assert!(log_len(&path) > PREALLOCATED_LOG);
                    writer
                        .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
                        .unwrap();
                }
            }
        }
    }

    #[test]
    fn a_failed_extension_fails_nothing_and_leaves_the_log_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        vfs::fail_extensions(true);
        vfs::take_extensions();
        let writer = open(&path, "FULL");
        commit_rows(&writer, 0, 100).unwrap();
        writer
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
            .unwrap();
        commit_rows(&writer, 100, 100).unwrap();
        vfs::fail_extensions(false);
        // Tried once, at the log's first header, then no more on this file.
        assert_eq!(vfs::take_extensions(), [(0, PREALLOCATED_LOG)]);
        // Cut back to what the frames need (a few pages), not left at the half-written zeros.
        assert!(log_len(&path) < PREALLOCATED_LOG / 8, "{}", log_len(&path));
        assert_eq!(count(&writer), 200);
        let (_copy, recovered) = crash_image(&path);
        assert_eq!(count(&recovered), 200);
    }

    #[test]
    fn a_read_only_store_on_a_preallocated_log_writes_nothing() {
        use crate::store::Store;
        // Each file's name and a digest of its bytes, sorted by name.
        let files = |dir: &std::path::Path| {
            use std::hash::{Hash, Hasher};
            let mut files: Vec<(String, u64)> = std::fs::read_dir(dir)
                .unwrap()
                .map(|entry| {
                    let entry = entry.unwrap();
                    let mut digest = std::collections::hash_map::DefaultHasher::new();
                    std::fs::read(entry.path()).unwrap().hash(&mut digest);
                    let name = entry.file_name().to_string_lossy().into_owned();
                    (name, digest.finish())
                })
                .collect();
            files.sort();
            files
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let store = crate::sqlite::Options::new().open(&path).unwrap();
        assert_eq!(log_len(&path), PREALLOCATED_LOG);
        // Beside the writing store (whose index a reader may take a read mark in, as every
        // reader does: the database and its log are compared).
        let before = files(dir.path());
        let reader = Store::open_read_only(&path).unwrap();
        assert!(reader.runs(None).unwrap().is_empty());
        drop(reader);
        let not_index = |files: Vec<(String, u64)>| {
            files
                .into_iter()
                .filter(|(name, _)| !name.ends_with("-shm"))
                .collect::<Vec<_>>()
        };
        assert_eq!(not_index(files(dir.path())), not_index(before));
        // As a crash would leave them (the log and its index), and the log alone (a copy).
        for keep_index in [true, false] {
            let copy = tempfile::tempdir().unwrap();
            for name in ["db", "db-wal", "db-shm"] {
                if keep_index || name != "db-shm" {
                    std::fs::copy(dir.path().join(name), copy.path().join(name)).unwrap();
                }
            }
            let copied = files(copy.path());
            let reader = Store::open_read_only(copy.path().join("db")).unwrap();
            assert!(reader.runs(None).unwrap().is_empty());
            drop(reader);
            assert_eq!(files(copy.path()), copied, "index kept: {keep_index}");
        }
        drop(store);
    }
}
