//! The `agentrt` binary's read commands never write: on every kind of database file they
//! leave each file byte for byte as it was and create nothing beside it. Its write commands
//! refuse, unchanged, a database they cannot or should not write. `events --follow` tells
//! what became of the run's executor and of the database.

use std::{
    io::Read,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    pin::pin,
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use agentrt::{
    Agent, ModelResponse, ResumeRun, RunId, Store, Supervisor,
    testkit::{Behaviour, RecordingTool, ScriptedModel, database_at_schema, with_system},
};
use assert_cmd::Command;
use serde_json::json;

use crate::support::{cli, files};

/// The variable that makes this test binary, started by a test, one of [`helper`]'s children.
const HELPER: &str = "AGENTRT_CLI_READ_ONLY_HELPER";
const HELPER_DB: &str = "AGENTRT_CLI_READ_ONLY_DB";

/// Not a test of its own: the child process the tests start to write a database and exit with
/// its connections open, as a process that dies does. Its log and the log's index stay beside
/// the file, and no process holds them.
#[test]
fn helper() {
    let Ok(what) = std::env::var(HELPER) else {
        return;
    };
    let path = PathBuf::from(std::env::var(HELPER_DB).unwrap());
    let _open = match what.as_str() {
        "seed" => {
            cli::seed(&path);
            cli::seed_waits(&path);
            None
        }
        // A commit left in the log: the store's writer never checkpoints by itself.
        "cancel" => {
            let store = Store::open(&path).unwrap();
            store
                .cancel(&RunId::from("wait"), "left in the log")
                .unwrap();
            Some(store)
        }
        other => panic!("no helper {other}"),
    };
    // Exits with the store still open: nothing closes its connections.
    std::process::exit(0);
}

/// Runs [`helper`]'s `what` on `path` in a child process.
fn in_child(what: &str, path: &Path) {
    let status = crate::support::child::test(module_path!(), "helper")
        .env(HELPER, what)
        .env(HELPER_DB, path)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the helper {what} failed");
}

/// A database seeded once per test binary, closed: nothing beside it.
fn seeded() -> &'static Path {
    static SEEDED: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    &SEEDED
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("agentrt.db");
            in_child("seed", &path);
            // Opened and closed here: the last connection copies the log into the file.
            drop(Store::open(&path).unwrap());
            assert_eq!(files(dir.path()).len(), 1, "a closed database alone");
            (dir, path)
        })
        .1
}

/// A copy of the seeded database, alone in a directory of its own.
fn copy() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentrt.db");
    std::fs::copy(seeded(), &path).unwrap();
    (dir, path)
}

fn agentrt(db: &Path) -> Command {
    let mut command = cli::agentrt(db);
    command.timeout(Duration::from_secs(30));
    command
}

/// A kind of database file the read commands are tried on.
struct Case {
    name: &'static str,
    dir: tempfile::TempDir,
    path: PathBuf,
    /// What a read command's stderr says, if it fails.
    refused: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut case = |name, (dir, path): (tempfile::TempDir, PathBuf), refused| {
        cases.push(Case {
            name,
            dir,
            path,
            refused,
        })
    };
    case("valid", copy(), None);

    let truncated = copy();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&truncated.1)
        .unwrap();
    file.set_len(file.metadata().unwrap().len() / 2).unwrap();
    case("truncated", truncated, Some("cut short"));

    let newer = copy();
    rusqlite::Connection::open(&newer.1)
        .unwrap()
        .execute_batch("PRAGMA user_version = 99")
        .unwrap();
    case("newer schema", newer, Some("newer"));

    let older_dir = tempfile::tempdir().unwrap();
    let older = older_dir.path().join("agentrt.db");
    database_at_schema(&older, 4);
    case("older schema", (older_dir, older), Some("older"));

    let read_only = copy();
    std::fs::set_permissions(&read_only.1, std::fs::Permissions::from_mode(0o444)).unwrap();
    case("read-only file", read_only, None);

    let in_read_only_dir = copy();
    std::fs::set_permissions(
        in_read_only_dir.0.path(),
        std::fs::Permissions::from_mode(0o555),
    )
    .unwrap();
    case("read-only directory", in_read_only_dir, None);

    let logged = copy();
    in_child("cancel", &logged.1);
    case("a log left by a dead process", logged, None);

    let log_alone = copy();
    in_child("cancel", &log_alone.1);
    std::fs::remove_file(log_alone.0.path().join("agentrt.db-shm")).unwrap();
    case("a log without its index", log_alone, None);
    for case in &cases {
        if case.name.contains("log") {
            let log = std::fs::metadata(case.dir.path().join("agentrt.db-wal")).unwrap();
            assert!(log.len() > 0, "{}: the log holds the cancel", case.name);
        }
    }
    cases
}

const READS: &[&[&str]] = &[
    &["runs"],
    &["--json", "show", "wait"],
    &["events", "done"],
    &["events", "done", "--follow"],
    &["lease", "crashed"],
    &["doctor"],
    &["migrate"],
    &["purge", "--dry-run", "--finished-before", "0s"],
    &["purge", "--dry-run", "--run", "done"],
    &["--json", "runs", "--limit", "1"],
    &["waits"],
    &["--json", "waits", "--kind", "answer"],
    &["show", "question"],
    &["schedules"],
    &["--json", "schedules"],
];

#[test]
fn read_commands_change_no_byte_and_create_nothing_on_any_database() {
    for case in cases() {
        let before = files(case.dir.path());
        for command in READS {
            let out = agentrt(&case.path).args(*command).output().unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            let what = format!("{} on {}: {stdout}{stderr}", command.join(" "), case.name);
            match (case.refused, command[0]) {
                // A report of the version, which an older schema is not refused for.
                (Some("older"), "migrate") => {
                    assert!(out.status.success(), "{what}");
                    assert!(stdout.contains("pending"), "{what}");
                }
                (Some("older"), "doctor") => {
                    assert!(!out.status.success(), "{what}");
                    assert!(stderr.contains("not current"), "{what}");
                }
                (Some(refused), _) => {
                    assert!(!out.status.success(), "{what}");
                    assert!(stderr.contains(refused), "{what}");
                }
                (None, _) => assert!(out.status.success(), "{what}"),
            }
            assert_eq!(
                files(case.dir.path()),
                before,
                "{what}: every file as it was, and no new one"
            );
        }
        if case.refused.is_none() {
            // The commit a dead process left in the log is read.
            let out = agentrt(&case.path)
                .args(["--json", "show", "wait"])
                .output()
                .unwrap();
            let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let expected = if case.name.contains("log") {
                "CANCELLED"
            } else {
                "WAITING_FOR_APPROVAL"
            };
            assert_eq!(shown["state"], json!(expected), "{}", case.name);
            let out = agentrt(&case.path)
                .args(["--json", "waits"])
                .output()
                .unwrap();
            let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(
                listed["waits"].as_array().unwrap().len(),
                5,
                "{}",
                case.name
            );
            // The file's journal mode, not the one of the connection that read it.
            let out = agentrt(&case.path).arg("doctor").output().unwrap();
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("journal_mode    wal"),
                "{}",
                case.name
            );
        }
    }
}

/// A database whose `events` table has a damaged page: the header and the schema read well,
/// SQLite's quick check does not.
fn damaged() -> (tempfile::TempDir, PathBuf) {
    let (dir, path) = copy();
    let (root, page_size): (i64, i64) = {
        let conn = rusqlite::Connection::open_with_flags(
            format!("file:{}?immutable=1", path.display()),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_URI,
        )
        .unwrap();
        (
            conn.query_row(
                "SELECT rootpage FROM sqlite_schema WHERE name = 'events'",
                [],
                |row| row.get(0),
            )
            .unwrap(),
            conn.query_row("PRAGMA page_size", [], |row| row.get(0))
                .unwrap(),
        )
    };
    let mut bytes = std::fs::read(&path).unwrap();
    // The page's cell count, far beyond what a page holds.
    let at = ((root - 1) * page_size + 3) as usize;
    bytes[at..at + 2].copy_from_slice(&[0xff, 0xff]);
    std::fs::write(&path, bytes).unwrap();
    (dir, path)
}

const WRITES: &[&[&str]] = &[
    &["cancel", "wait", "--reason", "duplicate"],
    &["approve", "wait", "pay-1", "--by", "alice"],
    &["deny", "wait", "pay-1", "--by", "bob"],
    &["answer", "question", "c1", r#"{"account": "savings"}"#],
    &["signal", "payment", "payment", "--id", "evt-1"],
    &["fork", "done", "--at", "1", "--id", "again"],
    &["purge", "--run", "done"],
    &["purge", "--finished-before", "0s"],
    &["vacuum"],
];

/// Each write command fails with one line saying `expected`, and changes nothing in `dir`.
fn refused_unchanged(dir: &Path, db: &Path, expected: &str) {
    let before = files(dir);
    for command in WRITES {
        let out = agentrt(db).args(*command).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{command:?}: {stderr}");
        assert!(
            stderr.contains(expected)
                && stderr.starts_with("agentrt: ")
                && stderr.lines().count() == 1,
            "{command:?}: {stderr}"
        );
        assert_eq!(files(dir), before, "{command:?}: nothing changed");
    }
}

#[test]
fn write_commands_refuse_a_damaged_database_unchanged() {
    let (dir, path) = damaged();
    refused_unchanged(
        dir.path(),
        &path,
        &format!("{} fails SQLite's quick integrity check", path.display()),
    );
    refused_unchanged(dir.path(), &path, "nothing was changed");
}

#[test]
fn write_commands_refuse_a_read_only_file_or_directory_and_a_directory() {
    let (dir, path) = copy();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    refused_unchanged(
        dir.path(),
        &path,
        &format!("{} is read-only: its permissions", path.display()),
    );

    let (dir, path) = copy();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    refused_unchanged(
        dir.path(),
        &path,
        &format!("{} is read-only: its directory", path.display()),
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();

    refused_unchanged(
        dir.path(),
        dir.path(),
        "is a directory, not a database file",
    );

    // A writable copy is written: the refusals above were the files'.
    let (_dir, path) = copy();
    agentrt(&path).args(WRITES[0]).assert().success();
}

/// `agentrt events RUN --follow` running, its output gathered as it comes.
struct Following {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Following {
    fn start(db: &Path, run: &str) -> Following {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_agentrt"))
            .arg("--db")
            .arg(db)
            .args(["events", run, "--follow"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let gather = |mut from: Box<dyn Read + Send>| {
            let text = Arc::new(Mutex::new(String::new()));
            let into = text.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    into.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
            text
        };
        let stdout = gather(Box::new(child.stdout.take().unwrap()));
        let stderr = gather(Box::new(child.stderr.take().unwrap()));
        Following {
            child,
            stdout,
            stderr,
        }
    }

    /// Waits until its stderr says `text` (or its stdout, with `out`).
    fn wait_for(&self, out: bool, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = if out { &self.stdout } else { &self.stderr };
        while !stream.lock().unwrap().contains(text) {
            assert!(
                Instant::now() < deadline,
                "never said {text:?}; stdout: {}; stderr: {}",
                self.stdout.lock().unwrap(),
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until it ends: whether it succeeded, and its stderr.
    fn wait_end(mut self) -> (bool, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The gathering threads read to the end of the closed pipes.
                std::thread::sleep(Duration::from_millis(50));
                return (status.success(), self.stderr.lock().unwrap().clone());
            }
            assert!(Instant::now() < deadline, "it never ended");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn following_ends_when_the_database_is_deleted_or_replaced() {
    let (dir, path) = copy();
    let following = Following::start(&path, "wait");
    following.wait_for(true, "run.started");
    std::fs::remove_file(&path).unwrap();
    let (ok, stderr) = following.wait_end();
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "stopped following run wait: {} was deleted or moved away",
            path.display()
        )),
        "{stderr}"
    );
    assert_eq!(files(dir.path()).len(), 0, "nothing created");

    let (_dir, path) = copy();
    let following = Following::start(&path, "wait");
    following.wait_for(true, "run.started");
    let (_other_dir, other) = copy();
    std::fs::rename(&other, &path).unwrap();
    let (ok, stderr) = following.wait_end();
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("was replaced by another file"), "{stderr}");
}

#[test]
fn following_tells_once_that_nobody_holds_the_lease_and_who_takes_the_run_over() {
    let (_dir, path) = copy();
    let following = Following::start(&path, "crashed");
    following.wait_for(false, "nobody holds its lease any more");
    // A resume takes the run over (its tool blocks until released), and it finishes.
    let tool = RecordingTool::new("pay")
        .idempotent(true)
        .behaviour(Behaviour::Block);
    let store = Store::open(&path).unwrap();
    let probe = tool.clone();
    let owner = with_system(|| async move {
        let sup = Supervisor::builder(store.clone())
            .agent(
                "plain",
                Agent::new(ScriptedModel::new(vec![ModelResponse::answer("paid")])).tool(tool),
            )
            .start()
            .unwrap();
        let resumed = sup.send(ResumeRun::new("crashed"));
        let mut resumed = pin!(resumed);
        let executing = probe.wait_executions(1);
        futures_util::future::select(resumed.as_mut(), pin!(executing)).await;
        let owner = store
            .lease(&RunId::from("crashed"))
            .unwrap()
            .expect("leased by the resume")
            .owner;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !following.stderr.lock().unwrap().contains("taken over by") {
            assert!(Instant::now() < deadline, "the take-over was never told");
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        probe.release();
        resumed.await.unwrap().unwrap();
        (owner, following)
    });
    let (owner, following) = owner;
    let (ok, stderr) = following.wait_end();
    assert!(ok, "{stderr}");
    assert_eq!(
        stderr.matches("nobody holds its lease any more").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "run crashed: taken over by {owner} (fencing token 2)\n"
        )),
        "{stderr}"
    );
    assert_eq!(stderr.matches("taken over by").count(), 1, "{stderr}");
}
