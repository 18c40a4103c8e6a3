//! The metrics tests' server: the API over a store, on 127.0.0.1, on a thread and actix system
//! of its own that outlive the supervisors' systems (each test crashes or stops those); a
//! scrape of it; and the turns its tests take at the process's recorder.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{Mutex, MutexGuard, mpsc},
};

use actix_web::{App, HttpServer};
use agentrt::{Store, web::Api};

/// Serves `store`'s scope at `/agentrt`; returns its address.
pub fn serve(store: Store) -> SocketAddr {
    let (sender, address) = mpsc::channel();
    std::thread::spawn(move || {
        actix_rt::System::new().block_on(async move {
            let api = Api::new(store);
            let server = HttpServer::new(move || App::new().service(api.scope("/agentrt")))
                .workers(1)
                .bind(("127.0.0.1", 0))
                .expect("a port on 127.0.0.1");
            sender.send(server.addrs()[0]).unwrap();
            server.run().await
        })
    });
    address.recv().expect("the server starts")
}

/// A response to `GET /agentrt/metrics`.
pub struct Scrape {
    /// The status line.
    pub status: String,
    /// The `content-type` header's value, empty if there is none.
    pub content_type: String,
    /// The body.
    pub body: String,
}

/// `GET /agentrt/metrics` of the server at `address`.
pub fn scrape(address: SocketAddr) -> Scrape {
    let mut stream = TcpStream::connect(address).expect("the server accepts");
    // HTTP/1.0: the body ends where the connection does.
    stream
        .write_all(b"GET /agentrt/metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    let status = head.lines().next().unwrap_or_default().to_owned();
    let content_type = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Scrape {
        status,
        content_type,
        body: body.to_owned(),
    }
}

/// Held by each test that reads agentrt's recorder, the process's: the counters one test
/// compares before and after its runs move with no other test's runs meanwhile.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    // A test that failed holding it leaves nothing to clean up.
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
