//! `agentrt serve` and `agentrt token`: the console and API as a process of their own on a
//! database file, its tokens, and its refusals.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use agentrt::{RunId, RunState};
use assert_cmd::Command;
use predicates::prelude::*;

use crate::support::cli::{agentrt, fixture};

/// A served process, killed when dropped.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 request, answered whole: the status and the body.
fn request(port: u16, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
    let mut socket = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        socket,
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{auth}\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

/// Starts `agentrt serve` and waits until it answers its health check.
fn serve(db: &Path, port: u16, extra: &[&str]) -> Served {
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("agentrt"))
        .arg("--db")
        .arg(db)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut served = Served(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "agentrt serve never listened");
        if let Some(status) = served.0.try_wait().unwrap() {
            panic!("agentrt serve exited with {status} before it listened (its port taken?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    served
}

#[test]
fn serve_refuses_a_network_address_without_tokens_and_changes_nothing() {
    let db = fixture();
    let before = std::fs::read(db.path()).unwrap();
    agentrt(db.path())
        .args(["serve", "--listen", "0.0.0.0:0"])
        .assert()
        .failure()
        .stderr(
            predicate::str::contains("refusing to listen").and(predicate::str::contains("token")),
        );
    assert_eq!(std::fs::read(db.path()).unwrap(), before);
}

#[test]
fn a_tokens_file_that_is_not_one_is_refused_with_its_line() {
    let db = fixture();
    let dir = tempfile::tempdir().unwrap();
    for (text, says) in [
        ("alice\n", "line 1"),
        ("# ops\nalice abc\n", "line 2"),
        ("# nobody\n\n", "names no operator"),
    ] {
        let file = dir.path().join("tokens");
        std::fs::write(&file, text).unwrap();
        agentrt(db.path())
            .args(["serve", "--tokens"])
            .arg(&file)
            .assert()
            .failure()
            .stderr(predicate::str::contains(says));
    }
    agentrt(db.path())
        .args(["serve", "--tokens", "/nonexistent/tokens"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("cannot read the tokens file"));
}

#[test]
fn a_token_made_by_agentrt_token_lets_its_operator_decide_through_serve() {
    let db = fixture();
    let made = Command::cargo_bin("agentrt")
        .unwrap()
        .args(["token", "alice"])
        .output()
        .unwrap();
    assert!(made.status.success());
    let text = String::from_utf8(made.stdout).unwrap();
    let mut lines = text.lines();
    let token = lines.next().unwrap().to_owned();
    let line = lines.next().unwrap();
    assert!(line.starts_with("alice "), "{line}");
    assert!(
        !line.contains(&token),
        "the file keeps the digest, not the token"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(&file, format!("# operators\n{line}\n")).unwrap();

    let port = free_port();
    let _served = serve(&db.path(), port, &["--tokens", file.to_str().unwrap()]);
    let (status, body) = request(port, "GET", "/health", None, "");
    assert_eq!(status, 200, "{body}");
    let (status, body) = request(port, "GET", "/ui/", None, "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("<html"), "{body}");
    // Without the token, refused; with it, recorded under alice's name.
    let (status, body) = request(port, "POST", "/runs/wait/calls/pay-1/approve", None, "");
    assert_eq!(status, 401, "{body}");
    let (status, body) = request(
        port,
        "POST",
        "/runs/wait/calls/pay-1/approve",
        Some(&token),
        r#"{"note": "from the console"}"#,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"by\":\"alice\""), "{body}");
    // This process executes nothing: the run waits, with its decision, for its supervisor.
    let store = db.open();
    let run = store.run(&RunId::from("wait")).unwrap();
    assert_eq!(run.state, RunState::WaitingForApproval);
    let events = store.events(&RunId::from("wait")).unwrap();
    assert!(events.iter().any(|e| e.payload["decided_by"] == "alice"));
}

#[test]
fn serve_stops_gracefully_on_sigterm_and_exits_cleanly() {
    let db = fixture();
    let port = free_port();
    let mut served = serve(&db.path(), port, &[]);
    assert_eq!(request(port, "GET", "/health", None, "").0, 200);
    // SAFETY: a plain kill(2) of our own child's pid.
    let sent = unsafe { libc::kill(served.0.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0);
    // Waits on the exit itself; a server that ignored the signal fails the test in a minute.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = served.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "agentrt serve did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "agentrt serve exited with {status}");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}
