//! A connection: the client, its prepared statements, and what its errors mean.

use std::{cell::Cell, collections::HashMap};

use postgres::{Client, NoTls, Statement, error::SqlState};

use super::Options;
use crate::error::{DatabaseError, Error, Result};

thread_local! {
    /// What the last error met on this thread asks of the transaction it was met in, until
    /// taken: a move keeps its statement's error as its own result, and the writer still has
    /// to know that the group is to be applied again (a conflict) or on a new connection.
    static NOTED: Cell<Noted> = const { Cell::new(Noted::Nothing) };
}

/// What an error asks of its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Noted {
    Nothing,
    /// Another transaction got in the way (a serialization failure, a deadlock): nothing was
    /// committed, and applying it again may succeed.
    Conflict,
    /// A write met a key that is taken: another writer's meanwhile (applying it again may
    /// succeed), or one that the move itself should not have written (it will not).
    KeyTaken,
    /// The connection broke: nothing more goes through it.
    Broken,
}

/// Takes what the errors met since the last call ask of the transaction.
pub(super) fn take_noted() -> Noted {
    NOTED.replace(Noted::Nothing)
}

/// Forgets a taken key noted since the last call (a deadlock, a serialization failure or a
/// broken connection stays noted): the move that met it was refused alone, and the
/// transaction goes on without it.
pub(super) fn forgive_key_taken() {
    if NOTED.get() == Noted::KeyTaken {
        NOTED.set(Noted::Nothing);
    }
}

/// agentrt's error for a driver's, noting what it asks of the transaction.
pub(crate) fn pg_error(err: postgres::Error) -> Error {
    let code = err.code();
    let conflict = code.is_some_and(|code| {
        *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
    });
    let key_taken = code.is_some_and(|code| *code == SqlState::UNIQUE_VIOLATION);
    let broken = err.is_closed()
        || code.is_some_and(|code| {
            *code == SqlState::ADMIN_SHUTDOWN
                || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
        })
        || (code.is_none()
            && std::error::Error::source(&err).is_some_and(|s| s.is::<std::io::Error>()));
    match (conflict, broken) {
        (_, true) => NOTED.set(Noted::Broken),
        // A deadlock or serialization failure outranks a taken key: it is applied again.
        (true, false) if NOTED.get() != Noted::Broken => NOTED.set(Noted::Conflict),
        (false, false) if key_taken && NOTED.get() == Noted::Nothing => NOTED.set(Noted::KeyTaken),
        _ => {}
    }
    let busy = code.is_some_and(|code| *code == SqlState::LOCK_NOT_AVAILABLE);
    Error::Database(DatabaseError::new(busy, err))
}

pub(super) trait Pg<T> {
    /// The result, its error made agentrt's by [`pg_error`].
    fn pg(self) -> Result<T>;
}

impl<T> Pg<T> for std::result::Result<T, postgres::Error> {
    fn pg(self) -> Result<T> {
        self.map_err(pg_error)
    }
}

/// One connection to the server, with the statements prepared on it.
///
/// The driver blocks on a runtime of its own, which cannot start inside another: a connection
/// opened or closed on an actix thread (a supervisor starting, a store dropped) is opened or
/// closed on a thread of its own.
pub(crate) struct Conn {
    client: Option<Client>,
    pub(super) statements: HashMap<String, Statement>,
}

/// Runs `f` here, or on a thread of its own when this thread runs an async runtime (an actix
/// arbiter's, where a store's inspection may be called from), which the driver's own runtime
/// cannot block.
pub(crate) fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|scope| scope.spawn(f).join().expect("the connection's thread"))
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(client) = self.client.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            // Closing sends the server a goodbye, through the driver's runtime.
            let _ = std::thread::Builder::new()
                .name("agentrt-pg-close".into())
                .spawn(move || drop(client));
        }
    }
}

impl Conn {
    /// The client and the statements prepared on it.
    pub(super) fn parts(&mut self) -> (&mut Client, &mut HashMap<String, Statement>) {
        (
            self.client.as_mut().expect("an open connection"),
            &mut self.statements,
        )
    }

    /// The client.
    pub(super) fn client(&mut self) -> &mut Client {
        self.parts().0
    }

    /// Opens a connection with the store's timeouts and session settings.
    pub(super) fn open(config: &tokio_postgres::Config, options: &Options) -> Result<Conn> {
        off_runtime(|| Conn::open_here(config, options))
    }

    fn open_here(config: &tokio_postgres::Config, options: &Options) -> Result<Conn> {
        let mut client = postgres::Config::from(config.clone()).connect(NoTls).pg()?;
        client.batch_execute(&session_settings(options)).pg()?;
        Ok(Conn {
            client: Some(client),
            statements: HashMap::new(),
        })
    }

    /// Whether the connection can still be used.
    pub(super) fn is_usable(&self) -> bool {
        self.client
            .as_ref()
            .is_some_and(|client| !client.is_closed())
    }
}

/// What every connection sets first: the timeout of a transaction left idle (a process that
/// stalled inside one), UTC, and read-only transactions for a read-only store.
pub(super) fn session_settings(options: &Options) -> String {
    let idle = options.idle_in_transaction.as_millis();
    let mut settings =
        format!("SET idle_in_transaction_session_timeout = {idle}; SET TIME ZONE 'UTC';");
    if options.read_only {
        settings.push_str(" SET default_transaction_read_only = on;");
    }
    settings
}

/// The driver's configuration for `url`, with the store's timeouts.
pub(super) fn config(url: &str, options: &Options) -> Result<tokio_postgres::Config> {
    let mut config: tokio_postgres::Config = url.parse().map_err(|err| {
        Error::InvalidInput(format!("{} is not a PostgreSQL URL: {err}", shown(url)))
    })?;
    let network = options.network_timeout;
    config
        .connect_timeout(options.connect_timeout)
        .keepalives(true)
        .keepalives_idle((network / 3).max(std::time::Duration::from_secs(1)))
        .keepalives_interval((network / 9).max(std::time::Duration::from_millis(100)))
        .keepalives_retries(3);
    #[cfg(target_os = "linux")]
    config.tcp_user_timeout(network);
    if config.get_application_name().is_none() {
        config.application_name("agentrt");
    }
    Ok(config)
}

/// `url` without its password (in the user part, or as a `password` parameter), for messages.
pub(super) fn shown(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (rest, None),
    };
    let location = match location.split_once('@') {
        Some((user, host)) if user.contains(':') => {
            let user = user.split(':').next().unwrap_or_default();
            format!("{user}:***@{host}")
        }
        _ => location.to_owned(),
    };
    let query = query.map(|query| {
        query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some(("password", _)) => "password=***".to_owned(),
                _ => pair.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("&")
    });
    match query {
        Some(query) => format!("{scheme}://{location}?{query}"),
        None => format!("{scheme}://{location}"),
    }
}
