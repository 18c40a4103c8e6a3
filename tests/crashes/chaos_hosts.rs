//! The chaos run's hosts (`examples/support/chaos_hosts.rs`): a host reaches a server on
//! loopback through its link and forwarder, a partition cuts it off and a restore joins it
//! again. Network namespaces need root: where they cannot be made, the test says so and does
//! nothing.

#[allow(dead_code)]
use std::{
    io::{BufRead, BufReader, Write},
    net::TcpListener,
    process::Output,
    time::Duration,
};

use crate::support::chaos_hosts::{Hosts, gateway};

/// An echo server on loopback: one line back per connection, for as long as the test runs.
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let address = listener.local_addr().expect("an address");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut line = String::new();
                let mut reader = BufReader::new(stream.try_clone().expect("clones"));
                if reader.read_line(&mut line).is_ok() {
                    let _ = (&stream).write_all(line.as_bytes());
                }
            });
        }
    });
    address
}

/// Host `i` sends a line to its gateway at `port` and prints the answer, within a second.
fn ask(hosts: &Hosts, i: u8, port: u16) -> Output {
    let script = format!(
        "exec 3<>/dev/tcp/{}/{port} && echo hello >&3 && read -t 1 answer <&3 && echo $answer",
        gateway(i)
    );
    hosts
        .command(i, "timeout".as_ref())
        .args(["2", "bash", "-c", &script])
        .output()
        .expect("runs")
}

#[test]
fn a_host_reaches_the_server_through_its_forwarder_until_cut_off() {
    let server = echo_server();
    let hosts = match Hosts::create(3, Some(server)) {
        Ok(hosts) => hosts,
        Err(err) => {
            eprintln!("no network namespaces here ({err}): nothing to check");
            return;
        }
    };
    for i in 0..3 {
        let output = ask(&hosts, i, server.port());
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "hello\n",
            "host {i}"
        );
    }
    hosts.cut(1).expect("cuts");
    assert!(!ask(&hosts, 1, server.port()).status.success());
    assert!(ask(&hosts, 2, server.port()).status.success());
    hosts.restore(1).expect("restores");
    // The link comes up at once; its carrier may take a moment.
    let back = (0..20).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        ask(&hosts, 1, server.port()).status.success()
    });
    assert!(back, "host 1 never reached the server again");
    let namespace = hosts.namespace(0);
    drop(hosts);
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("runs");
    assert!(!String::from_utf8_lossy(&list.stdout).contains(&namespace));
}
