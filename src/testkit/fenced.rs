//! A resource that fences by token: what an external system does to refuse the late attempt of
//! an owner that stalled inside a call while another took its run over.

use std::{
    collections::HashMap,
    io,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::Value;

use crate::{FencingToken, Reconciliation, Tool, ToolContext, ToolError, async_trait};

/// One write a [`FencedResource`] accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct Application {
    /// The idempotency key it was made for.
    pub key: String,
    /// The token it carried.
    pub token: FencingToken,
    /// What was written.
    pub value: Value,
    /// The process that made it.
    pub pid: u32,
}

/// One write a [`FencedResource`] refused: its token was lower than one already seen for its
/// key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The idempotency key.
    pub key: String,
    /// The token it carried.
    pub token: FencingToken,
    /// The highest token seen for the key when it came.
    pub fence: FencingToken,
    /// The process that made it.
    pub pid: u32,
}

/// What [`FencedResource::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The write was accepted and recorded.
    Applied,
    /// The write was refused: `fence`, a higher token, was seen for the key before.
    Refused {
        /// The highest token seen for the key.
        fence: FencingToken,
    },
}

/// A system that accepts a write for an idempotency key only with a fencing token at least as
/// high as any it has seen for that key, the way a payment API or a database can be made to:
///
/// - [`check`](Self::check), a tool's reconcile query, says whether a write was accepted for
///   the key, and counts as seeing its token: once a new owner has asked, no owner before it
///   can write;
/// - [`apply`](Self::apply), a tool's call, writes unless a higher token was seen, and records
///   what it accepted and what it refused.
///
/// [`in_memory`](Self::in_memory) keeps its state in the process; [`open`](Self::open) keeps it
/// in a file that processes share (an SQLite database, each operation one transaction), so a
/// test can show that a process stopped mid-call and taken over has its late write refused.
/// Clones share the state.
#[derive(Clone)]
pub struct FencedResource {
    backing: Backing,
}

#[derive(Clone)]
enum Backing {
    Memory(Arc<Mutex<Memory>>),
    File(Arc<Mutex<rusqlite::Connection>>),
}

#[derive(Default)]
struct Memory {
    fences: HashMap<String, FencingToken>,
    applications: Vec<Application>,
    refusals: Vec<Refusal>,
}

fn io_error(err: rusqlite::Error) -> io::Error {
    io::Error::other(err)
}

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS fences (key TEXT PRIMARY KEY, fence INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS applications (
        key TEXT NOT NULL, token INTEGER NOT NULL, value TEXT NOT NULL, pid INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS refusals (
        key TEXT NOT NULL, token INTEGER NOT NULL, fence INTEGER NOT NULL, pid INTEGER NOT NULL
    );";

impl FencedResource {
    /// A resource whose state lives in this process.
    pub fn in_memory() -> Self {
        FencedResource {
            backing: Backing::Memory(Arc::default()),
        }
    }

    /// A resource whose state lives in the file at `path` (created if absent), shared with every
    /// process that opens it. Every accepted write is durable before `apply` returns.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let conn = rusqlite::Connection::open(path).map_err(io_error)?;
        conn.busy_timeout(Duration::from_secs(30))
            .map_err(io_error)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(io_error)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(io_error)?;
        conn.execute_batch(SCHEMA).map_err(io_error)?;
        Ok(FencedResource {
            backing: Backing::File(Arc::new(Mutex::new(conn))),
        })
    }

    /// The reconcile query: raises the key's fence to `token` if it is higher, and answers with
    /// the value of the write accepted for the key, if any (the last one, should several have
    /// been).
    pub fn check(&self, key: &str, token: FencingToken) -> io::Result<Option<Value>> {
        match &self.backing {
            Backing::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let fence = memory.fences.entry(key.to_owned()).or_insert(token);
                *fence = (*fence).max(token);
                Ok(memory
                    .applications
                    .iter()
                    .rev()
                    .find(|a| a.key == key)
                    .map(|a| a.value.clone()))
            }
            Backing::File(conn) => {
                let mut conn = conn.lock().unwrap();
                let tx = conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .map_err(io_error)?;
                raise_fence(&tx, key, token)?;
                let value: Option<String> = tx
                    .query_row(
                        "SELECT value FROM applications WHERE key = ?1 ORDER BY rowid DESC",
                        [key],
                        |row| row.get(0),
                    )
                    .map(Some)
                    .or_else(|err| match err {
                        rusqlite::Error::QueryReturnedNoRows => Ok(None),
                        err => Err(err),
                    })
                    .map_err(io_error)?;
                tx.commit().map_err(io_error)?;
                value
                    .map(|text| serde_json::from_str(&text).map_err(io::Error::other))
                    .transpose()
            }
        }
    }

    /// Writes `value` for `key` under `token`, unless a higher token was seen for the key (by a
    /// write or a [`check`](Self::check)); the write raises the fence to its token.
    pub fn apply(&self, key: &str, token: FencingToken, value: Value) -> io::Result<Admission> {
        let pid = std::process::id();
        match &self.backing {
            Backing::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let fence = *memory.fences.get(key).unwrap_or(&token);
                if token < fence {
                    let key = key.to_owned();
                    memory.refusals.push(Refusal {
                        key,
                        token,
                        fence,
                        pid,
                    });
                    return Ok(Admission::Refused { fence });
                }
                memory.fences.insert(key.to_owned(), token);
                let key = key.to_owned();
                memory.applications.push(Application {
                    key,
                    token,
                    value,
                    pid,
                });
                Ok(Admission::Applied)
            }
            Backing::File(conn) => {
                let mut conn = conn.lock().unwrap();
                let tx = conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .map_err(io_error)?;
                let fence = raise_fence(&tx, key, token)?;
                let admission = if token < fence {
                    tx.execute(
                        "INSERT INTO refusals (key, token, fence, pid) VALUES (?1, ?2, ?3, ?4)",
                        rusqlite::params![key, token.get() as i64, fence.get() as i64, pid],
                    )
                    .map_err(io_error)?;
                    Admission::Refused { fence }
                } else {
                    tx.execute(
                        "INSERT INTO applications (key, token, value, pid) VALUES (?1, ?2, ?3, ?4)",
                        rusqlite::params![key, token.get() as i64, value.to_string(), pid],
                    )
                    .map_err(io_error)?;
                    Admission::Applied
                };
                tx.commit().map_err(io_error)?;
                Ok(admission)
            }
        }
    }

    /// Every write accepted, in order.
    pub fn applications(&self) -> io::Result<Vec<Application>> {
        match &self.backing {
            Backing::Memory(memory) => Ok(memory.lock().unwrap().applications.clone()),
            Backing::File(conn) => {
                let conn = conn.lock().unwrap();
                let mut stmt = conn
                    .prepare("SELECT key, token, value, pid FROM applications ORDER BY rowid")
                    .map_err(io_error)?;
                let rows = stmt
                    .query_map([], |row| {
                        Ok((
                            row.get::<_, String>(0)?,
                            row.get::<_, i64>(1)?,
                            row.get::<_, String>(2)?,
                            row.get::<_, u32>(3)?,
                        ))
                    })
                    .map_err(io_error)?;
                rows.map(|row| {
                    let (key, token, value, pid) = row.map_err(io_error)?;
                    Ok(Application {
                        key,
                        token: FencingToken::new(token as u64),
                        value: serde_json::from_str(&value).map_err(io::Error::other)?,
                        pid,
                    })
                })
                .collect()
            }
        }
    }

    /// Every write refused, in order.
    pub fn refusals(&self) -> io::Result<Vec<Refusal>> {
        match &self.backing {
            Backing::Memory(memory) => Ok(memory.lock().unwrap().refusals.clone()),
            Backing::File(conn) => {
                let conn = conn.lock().unwrap();
                let mut stmt = conn
                    .prepare("SELECT key, token, fence, pid FROM refusals ORDER BY rowid")
                    .map_err(io_error)?;
                let rows = stmt
                    .query_map([], |row| {
                        Ok(Refusal {
                            key: row.get(0)?,
                            token: FencingToken::new(row.get::<_, i64>(1)? as u64),
                            fence: FencingToken::new(row.get::<_, i64>(2)? as u64),
                            pid: row.get(3)?,
                        })
                    })
                    .map_err(io_error)?;
                rows.collect::<rusqlite::Result<_>>().map_err(io_error)
            }
        }
    }
}

/// Raises the fence of `key` to `token` if it is higher; returns the fence as it was before.
fn raise_fence(
    tx: &rusqlite::Transaction<'_>,
    key: &str,
    token: FencingToken,
) -> io::Result<FencingToken> {
    let before: Option<i64> = tx
        .query_row("SELECT fence FROM fences WHERE key = ?1", [key], |row| {
            row.get(0)
        })
        .map(Some)
        .or_else(|err| match err {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            err => Err(err),
        })
        .map_err(io_error)?;
    let before = before.map_or(token, |fence| FencingToken::new(fence as u64));
    tx.execute(
        "INSERT INTO fences (key, fence) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET fence = max(fence, excluded.fence)",
        rusqlite::params![key, token.get() as i64],
    )
    .map_err(io_error)?;
    Ok(before)
}

/// A tool that writes its arguments to a [`FencedResource`] under the call's idempotency key and
/// fencing token, and whose reconcile hook asks the resource: the pattern for a tool whose
/// system can fence. Not idempotent: a refused write is the tool's error, which the model sees.
#[derive(Clone)]
pub struct FencedTool {
    name: String,
    resource: FencedResource,
}

impl FencedTool {
    /// A tool named `name` writing to `resource`.
    pub fn new(name: impl Into<String>, resource: FencedResource) -> Self {
        FencedTool {
            name: name.into(),
            resource,
        }
    }
}

#[async_trait(?Send)]
impl Tool for FencedTool {
    fn name(&self) -> &str {
        &self.name
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        let admission = self
            .resource
            .apply(&ctx.idempotency_key, ctx.fencing_token, args.clone())
            .map_err(|err| ToolError::new(format!("the resource failed: {err}")))?;
        match admission {
            Admission::Applied => Ok(serde_json::json!({ "applied": args })),
            Admission::Refused { fence } => Err(ToolError::new(format!(
                "refused: token {} is older than token {fence}, seen for {}",
                ctx.fencing_token, ctx.idempotency_key
            ))),
        }
    }

    async fn reconcile(&self, ctx: &ToolContext, _: &Value) -> Option<Reconciliation> {
        Some(
            match self.resource.check(&ctx.idempotency_key, ctx.fencing_token) {
                Ok(Some(value)) => Reconciliation::Applied(serde_json::json!({ "applied": value })),
                Ok(None) => Reconciliation::NotApplied,
                Err(_) => Reconciliation::Unknown,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fences_by_token(resource: FencedResource) {
        let (one, two) = (FencingToken::new(1), FencingToken::new(2));
        assert_eq!(resource.check("k", two).unwrap(), None);
        // The owner of token 1 stalled: its write after the check of token 2 is refused.
        assert_eq!(
            resource.apply("k", one, json!(1)).unwrap(),
            Admission::Refused { fence: two }
        );
        assert_eq!(
            resource.apply("k", two, json!(2)).unwrap(),
            Admission::Applied
        );
        assert_eq!(resource.check("k", two).unwrap(), Some(json!(2)));
        // Another key has a fence of its own.
        assert_eq!(
            resource.apply("j", one, json!(3)).unwrap(),
            Admission::Applied
        );
        let applied: Vec<(String, u64)> = resource
            .applications()
            .unwrap()
            .into_iter()
            .map(|a| (a.key, a.token.get()))
            .collect();
        assert_eq!(applied, [("k".into(), 2), ("j".into(), 1)]);
        let refused = resource.refusals().unwrap();
        assert_eq!(refused.len(), 1);
        assert_eq!((refused[0].token, refused[0].fence), (one, two));
    }

    #[test]
    fn an_in_memory_resource_refuses_a_token_lower_than_one_seen_for_its_key() {
        fences_by_token(FencedResource::in_memory());
    }

    #[test]
    fn a_file_resource_refuses_a_token_lower_than_one_seen_for_its_key_across_opens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fences.sqlite");
        fences_by_token(FencedResource::open(&path).unwrap());
        // Another opener (another process, say) sees the same fences.
        let again = FencedResource::open(&path).unwrap();
        assert_eq!(
            again.apply("k", FencingToken::new(1), json!(9)).unwrap(),
            Admission::Refused {
                fence: FencingToken::new(2)
            }
        );
    }
}
