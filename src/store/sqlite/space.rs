//! Giving a database's free space back to the disk: after a purge, a step at a time, where
//! the database was created with `auto_vacuum = INCREMENTAL`; or all at once by `VACUUM`,
//! which also switches an older database to it.

use rusqlite::Connection;

use super::{database::Sqlite, error::Db};
use crate::{error::Result, store::Space};

/// Pages a step of the incremental vacuum frees: each step is a write transaction of its own,
/// so a running supervisor's moves wait at most one step (4 MiB of 4 KiB pages).
const PAGES_PER_STEP: u32 = 1024;

/// SQLite's `auto_vacuum` setting: 0 none, 1 full, 2 incremental.
fn auto_vacuum(conn: &Connection) -> Result<i64> {
    conn.pragma_query_value(None, "auto_vacuum", |row| row.get(0))
        .db()
}

/// The database's size and free space, in bytes.
fn sizes(conn: &Connection) -> Result<(u64, u64)> {
    let pragma = |name: &str| -> Result<u64> {
        conn.pragma_query_value(None, name, |row| row.get::<_, i64>(0))
            .db()
            .map(|n| n as u64)
    };
    let page = pragma("page_size")?;
    Ok((
        pragma("page_count")? * page,
        pragma("freelist_count")? * page,
    ))
}

impl Sqlite {
    /// See [`Backend::reclaim`](crate::store::backend::Backend::reclaim).
    pub(super) fn reclaim_space(&self) -> Result<Space> {
        let (before, returns_space) = self.on_writer("reading the database's size", |sql| {
            // After `sizes`, whose transaction reads the file's header: another connection's
            // vacuum may have switched the setting since this one last read it.
            let (before, _) = sizes(sql.0)?;
            Ok((before, auto_vacuum(sql.0)? != 0))
        })?;
        if returns_space {
            // The writer is taken for one step at a time: a supervisor of this store commits
            // between two steps.
            let mut left = u64::MAX;
            loop {
                let free = self.on_writer("giving free space back", |sql| {
                    sql.0
                        .execute_batch(&format!("PRAGMA incremental_vacuum({PAGES_PER_STEP})"))
                        .db()?;
                    sizes(sql.0).map(|(_, free)| free)
                })?;
                // Until none is left, or a step gives nothing back (other writers free pages
                // as fast): what remains goes at the next purge.
                if free == 0 || free >= left {
                    break;
                }
                left = free;
            }
        }
        self.measured(before, returns_space)
    }

    /// The space after a purge or a vacuum, once checkpointed: the file shrinks when the log's
    /// copy reaches it.
    fn measured(&self, before: u64, returns_space: bool) -> Result<Space> {
        self.checkpoint()?;
        let (after, free) = self.on_writer("reading the database's size", |sql| sizes(sql.0))?;
        Ok(Space {
            bytes_before: before,
            bytes_after: after,
            free_bytes: free,
            returns_space,
        })
    }

    /// See [`Backend::vacuum`](crate::store::backend::Backend::vacuum).
    pub(super) fn vacuum_all(&self) -> Result<Space> {
        let before = self.on_writer("vacuuming the database", |sql| {
            let (before, _) = sizes(sql.0)?;
            // The copy VACUUM builds goes to a temporary file, not to memory, where the writer
            // keeps its savepoint journals (`temp_store = MEMORY`): it is the database's size.
            sql.0
                .execute_batch("PRAGMA auto_vacuum = INCREMENTAL; PRAGMA temp_store = DEFAULT")
                .db()?;
            let vacuumed = sql.0.execute_batch("VACUUM").db();
            let restored = sql.0.execute_batch("PRAGMA temp_store = MEMORY").db();
            vacuumed.and(restored)?;
            Ok(before)
        })?;
        self.measured(before, true)
    }
}
