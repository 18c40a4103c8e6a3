//! A test that runs another test of its own binary as a child process, on a store the parent
//! names by its location (an SQLite file's path or a PostgreSQL URL, as `Store::connect` takes
//! it), and waits for the child's report before it kills it.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

/// Starts the ignored test `name` of this binary as a child process, with `var` naming the
/// store at `location`.
pub fn spawn(name: &str, var: &str, location: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(var, location)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// What follows `word` on the first line of the child's output that holds it. The output is
/// read on a thread, so that a child that never reports fails the test instead of hanging it:
/// the child is killed and the test panics after a minute.
pub fn report(child: &mut Child, word: &'static str) -> String {
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (report, reported) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let found = stdout
            .lines()
            .map_while(Result::ok)
            // libtest may print the test's name on the same line first.
            .find_map(|line| {
                line.split_once(word)
                    .map(|(_, rest)| rest.trim().to_owned())
            });
        let _ = report.send(found);
    });
    match reported.recv_timeout(Duration::from_secs(60)) {
        Ok(Some(rest)) => rest,
        other => {
            let _ = child.kill();
            panic!("the child did not report {word:?}: {other:?}");
        }
    }
}

/// Starts the ignored test `name` as a child process on the store at `location` (see [`spawn`]),
/// waits for its report of `word`, and kills it with SIGKILL, so that it writes nothing more;
/// answers what followed `word`.
pub fn killed_after(name: &str, var: &str, location: &str, word: &'static str) -> String {
    let mut child = spawn(name, var, location);
    let reported = report(&mut child, word);
    child.kill().unwrap();
    child.wait().unwrap();
    reported
}
