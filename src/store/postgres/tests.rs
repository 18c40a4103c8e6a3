//! The conformance suite on PostgreSQL, each store in a schema of its own on the test server
//! (skipped, saying so, when none is named).

use std::sync::Mutex;

use super::testing::{Schema, server};
use crate::{
    RunId, Store,
    error::Result,
    store::conformance::{Fixture, conformance_suite},
};

/// A connection of `store`'s own to its server, outside any lane.
fn connection(store: &Store) -> super::conn::Conn {
    store
        .backend()
        .as_any()
        .downcast_ref::<super::Postgres>()
        .expect("a PostgreSQL store")
        .connection()
        .unwrap()
}

/// Stores in fresh schemas, kept until the fixture is dropped.
struct Server {
    url: Option<String>,
    schemas: Mutex<Vec<Schema>>,
    options: fn() -> super::Options,
}

impl Server {
    fn new() -> Self {
        Server::with(super::Options::new)
    }

    fn with(options: fn() -> super::Options) -> Self {
        Server {
            url: server(),
            schemas: Mutex::new(Vec::new()),
            options,
        }
    }

    fn schema(&self) -> String {
        let schema = Schema::new(self.url.as_deref().expect("a test server"));
        let url = schema.url();
        self.schemas.lock().unwrap().push(schema);
        url
    }
}

impl Fixture for Server {
    fn available(&self) -> bool {
        self.url.is_some()
    }

    fn store(&self) -> Store {
        (self.options)().open(&self.schema()).unwrap()
    }

    fn expire_lease(&self, store: &Store, run_id: &RunId) {
        let mut conn = connection(store);
        let changed = conn
            .client()
            .execute(
                "UPDATE runs SET lease_expires_at =
                     floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 - 1
                 WHERE id = $1",
                &[&run_id.as_str()],
            )
            .unwrap();
        assert_eq!(changed, 1);
    }

    fn open_newer_schema(&self) -> Option<Result<Store>> {
        let url = self.schema();
        drop(super::Options::new().open(&url).unwrap());
        let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        client
            .execute(
                "INSERT INTO agentrt_migrations (version) VALUES ($1)",
                &[&(super::SCHEMA_VERSION as i32 + 1)],
            )
            .unwrap();
        Some(super::Options::new().open(&url))
    }
}

conformance_suite!(on_postgres, Server::new());

// One writer connection. Most cases apply their moves one at a time, outside any supervisor;
// those that go through a supervisor's writer (`in_one_group`) then meet in one pipelined
// group, so that a refusal found only at the group's next wait is rolled back alone.
conformance_suite!(
    on_postgres_in_one_lane,
    Server::with(|| crate::postgres::Options::new().writers(1))
);

// Every statement answered before the next, as a group is applied again after a refusal.
conformance_suite!(
    on_postgres_unpipelined,
    Server::with(|| crate::postgres::Options::new().pipeline(false))
);

/// A start that waited for the run's row (another transaction held it) past its lease's
/// expiry is refused: the server's clock is read once the row is held, not before the wait.
#[test]
fn a_start_that_waited_for_the_runs_row_past_its_lease_is_refused() {
    use crate::store::{
        conformance::{allow, call, create, model_answered_by, on, run},
        model::{Grant, Holder},
        moves::FIRST_TOKEN,
    };
    use std::time::Duration;

    let server = Server::new();
    if !server.available() {
        return;
    }
    let store = server.store();
    let grant = Grant::held(
        Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_millis(1500),
            margin: Duration::from_millis(200),
        },
        FIRST_TOKEN,
    );
    create(&store, &run("r"), &grant);
    model_answered_by(&store, &run("r"), &grant, vec![call("c1")]);
    let mut holder = connection(&store);
    let mut held = holder.client().transaction().unwrap();
    held.query("SELECT 1 FROM runs WHERE id = 'r' FOR UPDATE", &[])
        .unwrap();
    let (started, outcome) = std::sync::mpsc::channel();
    let starter = {
        let (store, grant) = (store.clone(), grant.clone());
        std::thread::spawn(move || {
            // The loop's own deadline has the margin when it asks.
            started.send(()).unwrap();
            on(&store, &run("r"), |m| {
                m.decide_tool(&grant, 2, &call("c1"), &allow())
            })
        })
    };
    outcome.recv().unwrap();
    // Held past the lease's expiry by the server's clock.
    std::thread::sleep(Duration::from_millis(1700));
    held.rollback().unwrap();
    let err = starter.join().unwrap().unwrap_err();
    assert!(
        matches!(err, crate::Error::LeaseLost { .. }) || err.is_run_state(),
        "{err}"
    );
    let events = store.events(&run("r")).unwrap();
    assert!(
        !events
            .iter()
            .any(|event| event.kind == crate::EventKind::ToolStarted),
        "{events:?}"
    );
}

/// The same through a supervisor's writer lane: the group waits for the row in its lock of
/// its runs, and the start is judged by the server's clock as read once the row is held, not
/// by the loop's deadline (which has time left here) or a reading from before the wait.
#[test]
fn a_start_whose_group_waited_for_the_runs_row_past_its_lease_is_refused() {
    use crate::store::{
        conformance::{
            allow, call, create, decide_tool, in_one_group, model_answered_by, queued, run,
        },
        model::{Grant, Holder},
        moves::FIRST_TOKEN,
    };
    use std::time::Duration;

    let server = Server::with(|| crate::postgres::Options::new().writers(1));
    if !server.available() {
        return;
    }
    let store = server.store();
    let grant = Grant::held(
        Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_millis(200),
        },
        FIRST_TOKEN,
    );
    create(&store, &run("r"), &grant);
    model_answered_by(&store, &run("r"), &grant, vec![call("c1")]);
    let mut holder = connection(&store);
    // The stored lease ends 600 ms from now by the server's clock; the loop's deadline is 30 s.
    holder
        .client()
        .execute(
            "UPDATE runs SET lease_expires_at =
                 floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 + 600
             WHERE id = 'r'",
            &[],
        )
        .unwrap();
    let mut held = holder.client().transaction().unwrap();
    held.query("SELECT 1 FROM runs WHERE id = 'r' FOR UPDATE", &[])
        .unwrap();
    let starter = {
        let (store, grant) = (store.clone(), grant.clone());
        std::thread::spawn(move || {
            let decide = decide_tool(&run("r"), &grant, 2, &call("c1"), &allow());
            in_one_group(&store, vec![queued(decide)])
        })
    };
    // Held until the stored lease has ended, by the server's clock.
    loop {
        let rows = held
            .query(
                "SELECT lease_expires_at < floor(extract(epoch FROM clock_timestamp()) * 1000)::int8
                 FROM runs WHERE id = 'r'",
                &[],
            )
            .unwrap();
        if rows[0].get::<_, bool>(0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    held.rollback().unwrap();
    assert_eq!(starter.join().unwrap(), [false], "the start was refused");
    let events = store.events(&run("r")).unwrap();
    assert!(
        !events
            .iter()
            .any(|event| event.kind == crate::EventKind::ToolStarted),
        "{events:?}"
    );
    assert!(
        grant.has_margin(),
        "refused by the stored lease, not the loop's deadline"
    );
}

/// A group whose move meets a deadlock on each of its first tries, the move-by-move ones
/// included, is applied again until it commits: only a taken key refuses a move alone. (The
/// deadlocks are a trigger's, raised by the insert of one run's step the first four times.)
#[test]
fn a_move_that_meets_a_deadlock_on_a_groups_later_tries_is_applied_again_not_refused() {
    use crate::store::{
        conformance::{create, in_one_group, me, queued, run},
        moves::{self, Leased},
    };

    let server = Server::with(|| crate::postgres::Options::new().writers(1));
    if !server.available() {
        return;
    }
    let store = server.store();
    let grant = me();
    for n in ["r1", "r2"] {
        create(&store, &run(n), &grant);
    }
    let mut conn = connection(&store);
    conn.client()
        .batch_execute(
            "CREATE SEQUENCE deadlocks;
             CREATE FUNCTION deadlock_first_four() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.run_id = 'r2' AND nextval('deadlocks') <= 4 THEN
                     RAISE EXCEPTION 'a deadlock, for the test' USING ERRCODE = '40P01';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER deadlocks BEFORE INSERT ON steps
                 FOR EACH ROW EXECUTE FUNCTION deadlock_first_four();",
        )
        .unwrap();
    let begin = |n: &str| {
        queued(moves::BeginModelStep {
            by: Leased::new(&run(n), &grant),
            step: 1,
        })
    };
    assert_eq!(
        in_one_group(&store, vec![begin("r1"), begin("r2")]),
        [true, true],
        "both committed, on the fifth try"
    );
    let tries: i64 = conn
        .client()
        .query_one("SELECT last_value FROM deadlocks", &[])
        .unwrap()
        .get(0);
    assert_eq!(tries, 5, "four deadlocks, then the insert that stood");
    for n in ["r1", "r2"] {
        let events = store.events(&run(n)).unwrap();
        assert_eq!(
            events.last().map(|event| event.kind),
            Some(crate::EventKind::ModelStarted),
            "{n}"
        );
    }
}
