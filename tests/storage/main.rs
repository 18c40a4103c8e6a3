//! Storage and migrations: commits, checkpoints, I/O errors, read-only opens, retention,
//! refusals that leave the folder as it was, and the migrations of older SQLite files.

#[path = "../support/mod.rs"]
mod support;

mod checkpoint;
mod events_migration;
mod first_open;
mod group_commit;
mod io_errors_are_sticky;
mod lease_migration;
mod read_while_closing;
mod refusals_leave_the_folder;
mod retention;
mod retention_migration;
mod steps_migration;
mod waiting_call_index;
