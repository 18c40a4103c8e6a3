//! A writer lane's connection: it pipelines. The writes of a group whose answers its moves do
//! not need (the steps and events they insert, the guarded touches that must change one row)
//! are sent without waiting; the lane waits only where a move reads, and the server answers
//! those writes first, in the order they were sent. So a group of many moves costs the round
//! trips of its reads and its commit rather than one per statement.
//!
//! A move whose write is answered with an error, or changed other than the rows it expected,
//! would have been refused: that is found the next time the lane waits, the transaction is
//! rolled back, and the group is applied again statement by statement, as an unpipelined
//! connection applies it. Nothing of a spoiled transaction is committed, and no move reads past
//! its spoiling.
//!
//! When every write that expects a count is guarded on the server (it fails, rather than
//! changing other rows than expected), the lane sends its `COMMIT` behind them without waiting:
//! a write that did not stand has aborted the transaction by then, and the server answers that
//! `COMMIT` by rolling it back. A group with nothing to read then costs one round trip.

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, Waker},
};

use postgres::{NoTls, Row, Statement, types::ToSql};
use tokio::runtime::Runtime;

use super::{
    Options,
    conn::{Pg, off_runtime, pg_error, session_settings},
    link::{Link, Owned, borrowed, counted},
};
use crate::error::{Error, Result};

type Answer = Pin<Box<dyn Future<Output = std::result::Result<u64, postgres::Error>> + Send>>;

/// What became of a transaction whose `COMMIT` was sent behind its writes.
pub(super) enum Behind {
    /// Every write stood, and the transaction committed.
    Committed,
    /// A write failed on the server, which rolled the whole transaction back.
    RolledBack,
    /// The `COMMIT` failed (its error says whether it rolled back).
    Failed(postgres::Error),
    /// The `COMMIT` was answered though a write had been refused: whether it committed is
    /// not known to be right.
    Unknown,
}

/// A write sent and not yet answered, with the rows it must change.
struct Sent {
    answer: Answer,
    expect: Option<u64>,
}

/// One pipelining connection to the server, on a runtime of its own.
pub(super) struct PipeConn {
    /// Taken only when dropped.
    runtime: Option<Runtime>,
    client: Arc<tokio_postgres::Client>,
    /// Prepared statements by their text and by whether they were prepared for small groups
    /// (see [`PipeConn::small_groups`]).
    statements: HashMap<(bool, String), Statement>,
    /// Whether the open transaction is a small group's: its statements are prepared apart.
    small: bool,
    sent: Vec<Sent>,
    /// Whether a write sent in the open transaction failed or changed other rows than it
    /// expected.
    spoiled: bool,
    /// Whether a write sent in the open transaction expects a count that only this side
    /// checks: its `COMMIT` must then wait for the answers.
    unguarded: bool,
    /// Whether a write sent in the open transaction failed on the server: the server aborted
    /// the transaction, and nothing of it can commit.
    aborted: bool,
    /// Whether writes wait for their answers (a group applied again after a spoiled try).
    pub(super) direct: bool,
    /// Set when the connection is not to be used again.
    discarded: bool,
}

impl PipeConn {
    /// Opens a connection with the store's timeouts and session settings.
    pub(super) fn open(config: &tokio_postgres::Config, options: &Options) -> Result<PipeConn> {
        off_runtime(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|err| Error::CommitFailed(format!("starting a writer runtime: {err}")))?;
            let (client, connection) = runtime.block_on(config.connect(NoTls)).pg()?;
            // The connection's task reads the server's answers whenever the lane waits.
            runtime.spawn(connection);
            runtime
                .block_on(client.batch_execute(&session_settings(options)))
                .pg()?;
            Ok(PipeConn {
                runtime: Some(runtime),
                client: Arc::new(client),
                statements: HashMap::new(),
                small: false,
                sent: Vec::new(),
                spoiled: false,
                unguarded: false,
                aborted: false,
                direct: false,
                discarded: false,
            })
        })
    }

    fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().expect("the connection's runtime")
    }

    /// Whether the connection can still be used.
    pub(super) fn is_usable(&self) -> bool {
        !self.discarded && !self.client.is_closed()
    }

    /// Marks the connection as not to be used again (it could not end a transaction).
    pub(super) fn discard(&mut self) {
        self.discarded = true;
    }

    /// Whether the transactions from now on are small groups'. A server keeps one plan of a
    /// prepared statement for every use, whatever settings made it: a small group's statements
    /// are prepared apart from a large one's (their text marked), so that the plans a small
    /// group's settings make serve only small groups, and a large group's only large ones.
    pub(super) fn small_groups(&mut self, small: bool) {
        self.small = small;
    }

    /// Opens a transaction (sent, not waited for): `sql` is `BEGIN` and what goes with it.
    pub(super) fn begin(&mut self, sql: &str) {
        self.spoiled = false;
        self.unguarded = false;
        self.aborted = false;
        let client = self.client.clone();
        let sql = sql.to_owned();
        self.send(
            Box::pin(async move { client.batch_execute(&sql).await.map(|()| 0) }),
            None,
        );
    }

    /// Waits for every write sent: whether the transaction still stands (none failed, each
    /// changed what it expected). A failure that asks for the group again is noted.
    pub(super) fn settle(&mut self) -> bool {
        if self.sent.is_empty() {
            return !self.spoiled;
        }
        let sent = std::mem::take(&mut self.sent);
        let answers = self.runtime().block_on(answered(sent));
        self.absorb(answers);
        !self.spoiled
    }

    /// Takes the answers of writes sent: a write that failed or changed other rows than it
    /// expected spoils the transaction.
    fn absorb(&mut self, answers: Vec<(std::result::Result<u64, postgres::Error>, Option<u64>)>) {
        for (answer, expect) in answers {
            match answer {
                Ok(changed) if expect.is_none_or(|expect| expect == changed) => {}
                Ok(_) => self.spoiled = true,
                Err(err) => {
                    self.aborted |= err.code().is_some();
                    // Noted for the lane when it asks for the group again (a conflict, a
                    // broken connection).
                    pg_error(err);
                    self.spoiled = true;
                }
            }
        }
    }

    /// Whether the open transaction's `COMMIT` may be sent before its writes are answered:
    /// none has been found to fail, and each that expects a count fails on the server when
    /// it does not change it.
    pub(super) fn may_commit_behind(&self) -> bool {
        !self.direct && !self.spoiled && !self.unguarded
    }

    /// Sends `COMMIT` behind the writes not yet answered and waits for every answer.
    pub(super) fn commit_behind(&mut self) -> Behind {
        debug_assert!(self.may_commit_behind());
        let sent = std::mem::take(&mut self.sent);
        let client = self.client.clone();
        let (answers, commit) = self.runtime().block_on(futures_util::future::join(
            answered(sent),
            client.batch_execute("COMMIT"),
        ));
        self.absorb(answers);
        // A statement that failed on the server has aborted the transaction: the `BEGIN` that
        // opened it heads the first batch sent, and cannot fail on its own (the settings sent
        // with it abort the transaction they are in if they fail).
        match commit {
            // The server found the transaction aborted by a write that failed, and rolled it
            // back; or the connection broke after such a failure, with the same outcome.
            _ if self.aborted => Behind::RolledBack,
            Err(err) => Behind::Failed(err),
            Ok(()) if self.spoiled => {
                // Every write that expects a count is guarded, so none can have been refused
                // without failing: this is not expected to happen.
                tracing::error!("a pipelined write was refused without failing on the server");
                Behind::Unknown
            }
            Ok(()) => Behind::Committed,
        }
    }

    /// Ends the open transaction with `sql` (`COMMIT` or `ROLLBACK`), once everything sent is
    /// answered.
    pub(super) fn finish(&mut self, sql: &str) -> std::result::Result<(), postgres::Error> {
        // What is still unanswered is answered first (and is of no more use).
        let sent = std::mem::take(&mut self.sent);
        let client = self.client.clone();
        self.runtime().block_on(async move {
            for sent in sent {
                let _ = sent.answer.await;
            }
            client.batch_execute(sql).await
        })
    }

    /// Sends `answer`'s request now: its first poll writes it into the connection's queue,
    /// which the connection's task sends in order the next time the lane waits.
    fn send(&mut self, mut answer: Answer, expect: Option<u64>) {
        let mut context = Context::from_waker(Waker::noop());
        match answer.as_mut().poll(&mut context) {
            // Only an error before the request was queued answers at once.
            Poll::Ready(Err(err)) => {
                pg_error(err);
                self.spoiled = true;
            }
            Poll::Ready(Ok(changed)) => {
                if expect.is_some_and(|expect| expect != changed) {
                    self.spoiled = true;
                }
            }
            Poll::Pending => self.sent.push(Sent { answer, expect }),
        }
    }

    /// Whether the open transaction may be committed: every write sent was answered as its
    /// move expected. The server answers the COMMIT of a transaction a statement failed in by
    /// rolling it back, without an error, so this is asked first.
    pub(super) fn stands(&self) -> bool {
        self.sent.is_empty() && !self.spoiled
    }

    /// Refuses to read past a spoiled write: the group is to be applied again.
    fn waited(&mut self) -> Result<()> {
        if self.settle() {
            Ok(())
        } else {
            Err(spoiled())
        }
    }
}

/// The answers of writes sent, in the order they were sent, each with the rows it expected.
async fn answered(
    sent: Vec<Sent>,
) -> Vec<(std::result::Result<u64, postgres::Error>, Option<u64>)> {
    let mut answers = Vec::with_capacity(sent.len());
    for sent in sent {
        answers.push((sent.answer.await, sent.expect));
    }
    answers
}

fn spoiled() -> Error {
    Error::CommitFailed(
        "an earlier write of this group was refused; the group is applied again".into(),
    )
}

impl Drop for PipeConn {
    fn drop(&mut self) {
        // A runtime cannot be dropped inside another (a lane that failed to start, on an actix
        // arbiter): there it is let go without waiting.
        if let Some(runtime) = self.runtime.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            runtime.shutdown_background();
        }
    }
}

impl Link for PipeConn {
    fn pipelines(&self) -> bool {
        !self.direct
    }

    fn check(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        counts: Vec<i64>,
    ) -> Result<bool> {
        if self.direct {
            let rows = self.query(statement, &borrowed(&params))?;
            return Ok(counted(&rows, &counts));
        }
        let client = self.client.clone();
        let statement = statement.clone();
        self.send(
            Box::pin(async move {
                let rows = client.query(&statement, &borrowed(&params)).await?;
                Ok(u64::from(counted(&rows, &counts)))
            }),
            Some(1),
        );
        Ok(true)
    }

    fn statement(&mut self, sql: &str) -> Result<Statement> {
        let key = (self.small, sql.to_owned());
        if let Some(statement) = self.statements.get(&key) {
            return Ok(statement.clone());
        }
        self.waited()?;
        let text = if self.small {
            format!("-- a small group's\n{sql}")
        } else {
            sql.to_owned()
        };
        let statement = self.runtime().block_on(self.client.prepare(&text)).pg()?;
        self.statements.insert(key, statement.clone());
        Ok(statement)
    }

    fn query(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        if self.direct || self.sent.is_empty() {
            self.waited()?;
            return self
                .runtime()
                .block_on(self.client.query(statement, params))
                .pg();
        }
        // Sent behind the writes not yet answered (a group's `BEGIN`, say), in the same round
        // trip; what it read is used only if every one of them stood.
        let sent = std::mem::take(&mut self.sent);
        let client = self.client.clone();
        let (answers, rows) = self.runtime().block_on(futures_util::future::join(
            answered(sent),
            client.query(statement, params),
        ));
        self.absorb(answers);
        if self.spoiled {
            return Err(spoiled());
        }
        rows.pg()
    }

    fn execute(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        self.waited()?;
        self.runtime()
            .block_on(self.client.execute(statement, params))
            .pg()
    }

    fn batch(&mut self, sql: &str) -> Result<()> {
        self.waited()?;
        self.runtime().block_on(self.client.batch_execute(sql)).pg()
    }

    fn write(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        expect: Option<u64>,
    ) -> Result<bool> {
        if self.direct {
            self.waited()?;
            let changed = self
                .runtime()
                .block_on(self.client.execute_raw(statement, params))
                .pg()?;
            return Ok(expect.is_none_or(|expect| expect == changed));
        }
        self.unguarded |= expect.is_some();
        let client = self.client.clone();
        let statement = statement.clone();
        self.send(
            Box::pin(async move { client.execute_raw(&statement, params).await }),
            expect,
        );
        Ok(true)
    }
}
