//! The metrics tests' server: the API over a store, on 127.0.0.1, on a thread and actix system
//! of its own that outlive the supervisors' systems (each test crashes or stops those).

use std::{net::SocketAddr, sync::mpsc};

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
