//! A test that runs another test of its own binary as a child process, on a store the parent
//! names by its location (an SQLite file's path or a PostgreSQL URL, as `Store::connect` takes
//! it), and waits for the child's report before it kills it.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use agentrt::{
    Store,
    testkit::{Behaviour, RecordingTool},
};

/// A command that runs test `name` of the module `module` (the `module_path!()` of its file)
/// of this binary, and nothing else, in a child process: whether it is ignored or not, its
/// output not captured.
pub fn test(module: &str, name: &str) -> Command {
    // libtest names a test by its path below the crate: the module's, less the binary's name.
    let (_, path) = module.split_once("::").expect("a module of a test binary");
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args([
        "--include-ignored",
        "--exact",
        &format!("{path}::{name}"),
        "--nocapture",
        "--test-threads=1",
    ]);
    command
}

/// Starts the ignored test `name` of `module` (see [`test`]) as a child process, with `var`
/// naming the store at `location`.
pub fn spawn(module: &str, name: &str, var: &str, location: &str) -> Child {
    test(module, name)
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

/// Starts the ignored test `name` of `module` as a child process on the store at `location`
/// (see [`spawn`]),
/// waits for its report of `word`, and kills it with SIGKILL, so that it writes nothing more;
/// answers what followed `word`.
pub fn killed_after(
    module: &str,
    name: &str,
    var: &str,
    location: &str,
    word: &'static str,
) -> String {
    let mut child = spawn(module, name, var, location);
    let reported = report(&mut child, word);
    child.kill().unwrap();
    child.wait().unwrap();
    reported
}

/// The child's side: the store the parent named in `var` (see [`spawn`]), and a `provision`
/// tool whose calls block until the process is killed.
pub fn store_and_stuck_tool(var: &str) -> (Store, RecordingTool) {
    let location = std::env::var(var).expect("run by the parent test");
    let tool = RecordingTool::new("provision").behaviour(Behaviour::BlockIgnoringCancel);
    (Store::connect(&location).unwrap(), tool)
}
