//! What a store reports of its own health, and a database's schema version.

use serde::{Deserialize, Serialize};

use crate::types::{Lease, RunId};

/// The schema version of a database, as found and as this build writes it. JSON:
/// `{"found": 7, "supported": 7}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaStatus {
    /// The version the database is at (0: an empty database).
    pub found: u32,
    /// The version this build writes.
    pub supported: u32,
}

impl SchemaStatus {
    /// Migrations this build would apply.
    pub fn pending(&self) -> u32 {
        self.supported.saturating_sub(self.found)
    }
}

/// What [`Store::health`](super::Store::health) found. JSON: its fields by name, `settings` as a list of
/// `[name, value]` pairs and each stale lease as `[run_id, lease]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// The schema version.
    pub schema: SchemaStatus,
    /// The backend's settings, by name, as it reports them (for SQLite: `journal_mode`,
    /// `synchronous` as this store's writers commit with it, by name, and `foreign_keys`,
    /// `trusted_schema`, `busy_timeout`, `defensive` of the inspection connection; and the
    /// file's `auto_vacuum`, `none` or `incremental` (whether a purge gives space back to the
    /// disk), with `freelist_count`, its pages that hold nothing).
    pub settings: Vec<(String, String)>,
    /// What the backend's integrity check said: `["ok"]` for a sound database.
    pub integrity: Vec<String>,
    /// RUNNING runs whose lease has expired: their executor died or stalled; a resume takes
    /// them over.
    pub stale_leases: Vec<(RunId, Lease)>,
    /// RUNNING runs nobody holds: their call returned with an error, or they are forks not
    /// executed yet; a resume takes them over.
    pub running_without_lease: Vec<RunId>,
}

impl Health {
    /// True when the database is sound and its schema current.
    pub fn is_ok(&self) -> bool {
        self.integrity == ["ok"] && self.schema.pending() == 0
    }

    /// The setting `name`, as the backend reported it.
    pub fn setting(&self, name: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|(setting, _)| setting == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A database's size, and the space inside it that holds nothing. JSON: its fields by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Space {
    /// Bytes the database took before its free space was given back.
    pub bytes_before: u64,
    /// Bytes it takes now.
    pub bytes_after: u64,
    /// Bytes inside it that hold nothing: kept for later writes, not given back to the disk.
    /// Non-zero after a purge on a database that cannot shrink by itself
    /// ([`returns_space`](Self::returns_space) false).
    pub free_bytes: u64,
    /// Whether the database gives the space of deleted rows back to the disk after a purge.
    /// SQLite: whether it was created with `auto_vacuum = INCREMENTAL`, which agentrt does for
    /// every new database; an older one switches with [`Store::vacuum`](super::Store::vacuum).
    pub returns_space: bool,
}
