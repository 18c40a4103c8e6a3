//! What the SQL of a transaction runs over: a link that answers each statement before the
//! next (an inspection's, an operator's move, a renewal), or a writer lane's pipeline, which
//! sends the writes whose answers a move does not need and waits only where it reads.

use std::collections::HashMap;

use postgres::{Row, Statement, Transaction, types::ToSql};

use super::conn::Pg;
use crate::error::Result;

/// A parameter owned by the statement it is sent with, so that a write can be sent now and
/// answered later.
pub(super) type Owned = Box<dyn ToSql + Send + Sync>;

/// The statements of one transaction.
pub(super) trait Link {
    /// The statement prepared for `sql` on this connection, prepared once.
    fn statement(&mut self, sql: &str) -> Result<Statement>;
    /// The rows `statement` answers: everything sent before it has been answered too.
    fn query(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>>;
    /// How many rows `statement` changed: everything sent before it has been answered too.
    fn execute(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<u64>;
    /// Runs statements without parameters, answered before this returns.
    fn batch(&mut self, sql: &str) -> Result<()>;
    /// A write whose answer the move needs only as "it changed `expect` rows" (any number
    /// when `None`). A link that answers each statement at once says whether it did; a
    /// pipeline sends it, answers `true`, and checks it (with every other write it sent) the
    /// next time it waits: a write found to have failed or to have changed other than
    /// `expect` rows spoils the transaction, which is then applied again statement by
    /// statement.
    fn write(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        expect: Option<u64>,
    ) -> Result<bool>;

    /// Like [`Link::write`], for a statement that answers one row of counts and fails on the
    /// server when they are not `counts` (see [`super::held`]): whether it answered them. A
    /// pipeline may send its `COMMIT` behind such a write before its answer.
    fn check(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        counts: Vec<i64>,
    ) -> Result<bool>;
    /// Whether writes are sent without waiting for their answers.
    fn pipelines(&self) -> bool {
        false
    }
}

/// A transaction of the synchronous client: every statement answered before the next.
pub(super) struct Direct<'a, 'c> {
    pub tx: &'a mut Transaction<'c>,
    pub statements: &'a mut HashMap<String, Statement>,
}

/// Whether `rows` is one row of `counts`.
pub(super) fn counted(rows: &[Row], counts: &[i64]) -> bool {
    match rows {
        [row] => {
            (0..counts.len()).all(|index| row.try_get::<_, i64>(index).ok() == Some(counts[index]))
        }
        _ => false,
    }
}

/// `params` as the driver takes them.
pub(super) fn borrowed(params: &[Owned]) -> Vec<&(dyn ToSql + Sync)> {
    params
        .iter()
        .map(|param| &**param as &(dyn ToSql + Sync))
        .collect()
}

impl Link for Direct<'_, '_> {
    fn statement(&mut self, sql: &str) -> Result<Statement> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.tx.prepare(sql).pg()?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    fn query(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        self.tx.query(statement, params).pg()
    }

    fn execute(&mut self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        self.tx.execute(statement, params).pg()
    }

    fn batch(&mut self, sql: &str) -> Result<()> {
        self.tx.batch_execute(sql).pg()
    }

    fn write(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        expect: Option<u64>,
    ) -> Result<bool> {
        let changed = self.tx.execute(statement, &borrowed(&params)).pg()?;
        Ok(expect.is_none_or(|expect| expect == changed))
    }

    fn check(
        &mut self,
        statement: &Statement,
        params: Vec<Owned>,
        counts: Vec<i64>,
    ) -> Result<bool> {
        let rows = self.tx.query(statement, &borrowed(&params)).pg()?;
        Ok(counted(&rows, &counts))
    }
}
