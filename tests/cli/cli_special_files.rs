//! `--db` naming something that is not a regular file (a named pipe, a socket): every command
//! refuses it at once, saying what it is, and writes nothing. A named pipe is never opened:
//! opening one waits for a writer, which would hang the command.

use std::{
    os::unix::{fs::FileTypeExt, net::UnixListener},
    path::Path,
    time::Duration,
};

use crate::support::{cli::agentrt, entries};

/// Every command that takes a database, with arguments it accepts.
const COMMANDS: &[&[&str]] = &[
    &["runs"],
    &["show", "r"],
    &["events", "r"],
    &["events", "r", "--follow"],
    &["lease", "r"],
    &["cancel", "r", "--reason", "x"],
    &["approve", "r", "c", "--by", "b"],
    &["deny", "r", "c", "--by", "b"],
    &["fork", "r", "--at", "1"],
    &["purge", "--finished-before", "0s"],
    &["purge", "--dry-run", "--finished-before", "0s"],
    &["vacuum"],
    &["migrate"],
    &["migrate", "--apply"],
    &["doctor"],
    &["serve", "--listen", "127.0.0.1:0"],
];

/// Far longer than a refusal takes on any machine: a command still running then hangs.
const HANG: Duration = Duration::from_secs(20);

/// Runs every command on `db`: each must fail at once, saying `what` it is, and leave the
/// folder as it was.
fn every_command_refuses(db: &Path, what: &str) {
    let dir = db.parent().unwrap();
    let before = entries(dir);
    for command in COMMANDS {
        let out = agentrt(db).args(*command).timeout(HANG).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(&format!("is {what}, not a database file")),
            "{command:?} on {what}: exit code {:?} (none: it hung, and was killed), stderr \
             {stderr:?}",
            out.status.code()
        );
        assert_eq!(entries(dir), before, "{command:?} on {what}");
    }
}

#[test]
fn every_command_refuses_a_named_pipe_at_once_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("agentrt.db");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    every_command_refuses(&fifo, "a named pipe (FIFO)");
}

#[test]
fn every_command_refuses_a_socket_at_once_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agentrt.db");
    let _listening = UnixListener::bind(&socket).unwrap();
    every_command_refuses(&socket, "a socket");
}
