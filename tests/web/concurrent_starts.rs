//! Many `POST /runs` of one run id at once, as a client that retries sends them: one starts
//! the run (202), and every other is a 409 `run_exists`, never `run_leased` (which tells the
//! client to retry) nor a 404.

use std::collections::BTreeMap;

use agentrt::{
    Agent,
    testkit::{Behaviour, RecordingTool, TempStore, with_system},
};
use futures_util::future::join_all;
use serde_json::json;

use crate::support::{
    call_then_answer,
    web::{Client, code, serve_supervised},
};

#[test]
fn fifty_starts_of_one_id_at_once_over_http_start_it_once_and_the_rest_are_run_exists() {
    let db = TempStore::new();
    let store = db.open();
    // The run blocks in its tool: it executes while the starts come.
    let tool = RecordingTool::new("t").behaviour(Behaviour::Block);
    let agent = Agent::new(call_then_answer("c1", "t", json!({}), "done")).tool(tool.clone());
    let answers = {
        let (store, tool) = (store.clone(), tool.clone());
        with_system(|| async move {
            let (addr, _supervisor, _) = serve_supervised(&store, "a", agent, |api| api).await;
            let client = Client::new(addr, None);
            let body = json!({"agent": "a", "run_id": "r1"});
            let answers = join_all((0..50).map(|_| client.post("/runs", body.clone()))).await;
            tool.wait_executions(1).await;
            answers
        })
    };
    let mut by_answer: BTreeMap<(u16, String), usize> = BTreeMap::new();
    for (status, body) in &answers {
        let what = match status {
            202 => body["run_id"].to_string(),
            _ => code(body).to_owned(),
        };
        *by_answer.entry((*status, what)).or_default() += 1;
    }
    let expected = BTreeMap::from([
        ((202, "\"r1\"".to_owned()), 1),
        ((409, "run_exists".to_owned()), 49),
    ]);
    assert_eq!(by_answer, expected);
    assert_eq!(store.runs(None).unwrap().len(), 1);
    assert_eq!(tool.executions().len(), 1);
}
