//! The chaos run's hosts: one network namespace per worker, joined to the root namespace by a
//! veth pair, with a TCP forwarder in the parent as each host's only way to the database
//! server; a partition takes a host's link down. And the wall-clock skew a host runs with,
//! through libfaketime.
//!
//! Host `i` has the namespace `agentrt-chaos-<pid>-<i>`, the root side of its link at
//! `10.231.<i>.1/30` and its own side at `10.231.<i>.2/30`. The server listens on loopback
//! only, so the parent listens on `10.231.<i>.1` at the server's port and forwards each
//! connection to the server, one thread per direction. Everything is removed when [`Hosts`]
//! is dropped, on a panic too: the namespaces, the links, the forwarders.

use std::{
    io::{self, Read, Write},
    net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

/// How often a forwarder's blocked read or write looks whether it should stop.
const POLL: Duration = Duration::from_millis(100);

/// The library that shifts a process's wall clock (Debian's `libfaketime`).
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Runs `ip` with `args`; its stderr on failure.
fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|err| format!("ip {}: {err} (is iproute2 installed?)", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The namespaces, links and forwarders of a chaos run's hosts, until dropped.
pub struct Hosts {
    prefix: String,
    count: u8,
    stop: Arc<AtomicBool>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Hosts {
    /// Makes `count` hosts, each with a forwarder to `server` (a TCP address on loopback) on
    /// its root-side address, or none if `server` is `None`. Needs root and iproute2.
    pub fn create(count: u8, server: Option<SocketAddr>) -> Result<Hosts, String> {
        let hosts = Hosts {
            prefix: format!("agentrt-chaos-{}", std::process::id()),
            count,
            stop: Arc::new(AtomicBool::new(false)),
            threads: Arc::default(),
        };
        // On an error, dropping `hosts` removes what was made.
        for i in 0..count {
            let (ns, outer, inner) = (hosts.namespace(i), hosts.outer(i), hosts.inner(i));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner, "netns", &ns,
            ])?;
            ip(&["addr", "add", &format!("{}/30", gateway(i)), "dev", &outer])?;
            ip(&["link", "set", &outer, "up"])?;
            let address = format!("{}/30", Ipv4Addr::new(10, 231, i, 2));
            ip(&["-n", &ns, "addr", "add", &address, "dev", &inner])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(server) = server {
                hosts.forward(i, server)?;
            }
        }
        Ok(hosts)
    }

    /// The network namespace of host `i`.
    pub fn namespace(&self, i: u8) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// The root side of host `i`'s link (an interface name has at most 15 bytes).
    fn outer(&self, i: u8) -> String {
        format!("acr{}x{i}", std::process::id())
    }

    /// Host `i`'s side of its link.
    fn inner(&self, i: u8) -> String {
        format!("acn{}x{i}", std::process::id())
    }

    /// A command that runs `program` inside host `i`'s namespace (`ip netns exec` enters it
    /// and execs the program, so the child's pid is the program's).
    pub fn command(&self, i: u8, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.namespace(i)])
            .arg(program);
        command
    }

    /// Cuts host `i` off the network: its link goes down, so nothing it sends arrives, and
    /// the forwarder's connections to it stay open, as a server's do across a partition.
    pub fn cut(&self, i: u8) -> Result<(), String> {
        ip(&["link", "set", &self.outer(i), "down"])
    }

    /// Joins host `i` to the network again.
    pub fn restore(&self, i: u8) -> Result<(), String> {
        ip(&["link", "set", &self.outer(i), "up"])
    }

    /// Listens on host `i`'s root-side address at `server`'s port, forwarding to `server`.
    fn forward(&self, i: u8, server: SocketAddr) -> Result<(), String> {
        let listen = SocketAddrV4::new(gateway(i), server.port());
        let listener =
            TcpListener::bind(listen).map_err(|err| format!("a forwarder on {listen}: {err}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|err| err.to_string())?;
        let (stop, threads) = (self.stop.clone(), self.threads.clone());
        let accept = std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        if let Err(err) = connect(client, server, &stop, &threads) {
                            eprintln!("forwarder {listen}: {err}");
                        }
                    }
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(POLL / 5);
                    }
                    Err(err) => eprintln!("forwarder {listen}: {err}"),
                }
            }
        });
        self.threads.lock().expect("not poisoned").push(accept);
        Ok(())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for thread in threads {
            let _ = thread.join();
        }
        // Deleting one end of a veth pair deletes both. A namespace lives on until its last
        // process ends: the parent kills the workers first.
        for i in 0..self.count {
            let _ = ip(&["link", "del", &self.outer(i)]);
            if let Err(err) = ip(&["netns", "del", &self.namespace(i)])
                && !err.contains("No such file")
            {
                eprintln!("{err}");
            }
        }
    }
}

/// The root side of host `i`'s link: where it finds the server.
pub fn gateway(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 231, i, 1)
}

/// Connects `client` to `server` and copies both ways, a thread per direction.
fn connect(
    client: TcpStream,
    server: SocketAddr,
    stop: &Arc<AtomicBool>,
    threads: &Mutex<Vec<JoinHandle<()>>>,
) -> io::Result<()> {
    client.set_nonblocking(false)?;
    // The server side of a partitioned host's connection learns that the host died only by
    // probing it, as a server with TCP keepalives does: without, a session killed inside a
    // transaction during a partition would hold its locks for good.
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(2))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    socket2::SockRef::from(&client).set_tcp_keepalive(&keepalive)?;
    let upstream = TcpStream::connect_timeout(&server, Duration::from_secs(2))?;
    for stream in [&client, &upstream] {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(POLL))?;
        stream.set_write_timeout(Some(POLL))?;
    }
    let pairs = [
        (client.try_clone()?, upstream.try_clone()?),
        (upstream, client),
    ];
    let mut threads = threads.lock().expect("not poisoned");
    // Finished connections' threads are joined as new ones come, so the list stays short.
    threads.retain(|thread| !thread.is_finished());
    for (from, to) in pairs {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || copy(from, to, &stop)));
    }
    Ok(())
}

/// Copies `from` to `to` until either ends or the forwarders stop, then ends both.
fn copy(mut from: TcpStream, mut to: TcpStream, stop: &AtomicBool) {
    let timed_out = |err: &io::Error| {
        matches!(
            err.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        )
    };
    let mut buf = vec![0; 64 * 1024];
    'copy: while !stop.load(Ordering::Relaxed) {
        let read = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(read) => read,
            Err(err) if timed_out(&err) => continue,
            Err(_) => break,
        };
        let mut written = 0;
        while written < read {
            match to.write(&buf[written..read]) {
                Ok(0) => break 'copy,
                Ok(n) => written += n,
                Err(err) if timed_out(&err) && !stop.load(Ordering::Relaxed) => {}
                Err(_) => break 'copy,
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// The environment that runs a process `skew_ms` milliseconds off the true wall clock, with
/// its monotonic clock untouched (`Instant`, and so the lease deadlines a loop keeps, stays
/// true).
pub fn skew_env(skew_ms: i64) -> [(&'static str, String); 3] {
    [
        ("LD_PRELOAD", LIBFAKETIME.to_owned()),
        ("FAKETIME", format!("{:+.3}", skew_ms as f64 / 1000.0)),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ]
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// From now on, SIGINT and SIGTERM only set [`interrupted`], so the parent can stop its
/// workers and remove its hosts before it exits.
pub fn catch_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// SIGINT and SIGTERM end the process again.
pub fn release_interrupts() {
    // SAFETY: restoring the default disposition.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
    }
}

/// Whether a SIGINT or SIGTERM came since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}
