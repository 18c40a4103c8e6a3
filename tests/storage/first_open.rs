//! The first open of a new SQLite file writes it: the file's settings, then its switch to WAL
//! mode (a commit of its own, in rollback-journal mode), then the migrations. A write or a sync
//! of the database file that fails in any of them fails the open; none is passed over to
//! leave a store that runs in rollback-journal mode, or on a file whose state is unknown.

use agentrt::{
    Store,
    testkit::{FaultKind, Faults, TempStore, faults},
};

/// Fails each call of `kind` the first open of a new file makes of its database file in turn
/// (the first, then the second, ...), until an open makes fewer: every open whose call failed
/// must fail. Returns the errors' messages.
fn every_failed_call_fails_the_first_open(kind: FaultKind) -> Vec<String> {
    let mut refused = Vec::new();
    for passing in 0.. {
        let db = TempStore::sqlite();
        let path = db.path();
        Faults::fail_at_open(&path, kind, passing);
        match Store::open(&path) {
            Err(err) => refused.push(err.to_string()),
            Ok(store) => {
                assert_eq!(
                    faults(&store).unwrap().injected(),
                    0,
                    "{kind:?}: the open after {passing} calls passed met its fault, and \
                     opened anyway"
                );
                break;
            }
        }
        // Opened again with the disk sound, it is a sound store in WAL mode.
        let health = Store::open(&path).unwrap().health().unwrap();
        assert_eq!(health.setting("journal_mode"), Some("wal"), "{health:?}");
        assert!(health.is_ok(), "{health:?}");
    }
    refused
}

#[test]
fn a_failed_sync_while_a_new_database_is_put_in_wal_mode_fails_the_open() {
    let refused = every_failed_call_fails_the_first_open(FaultKind::DatabaseSync);
    assert!(
        refused.iter().any(|text| text.contains("WAL mode")),
        "{refused:?}"
    );
}

#[test]
fn a_failed_write_while_a_new_database_is_put_in_wal_mode_fails_the_open() {
    let refused = every_failed_call_fails_the_first_open(FaultKind::DatabaseWrite);
    assert!(
        refused.iter().any(|text| text.contains("WAL mode")),
        "{refused:?}"
    );
}
