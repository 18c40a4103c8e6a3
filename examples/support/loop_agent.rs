//! The benchmarks' agent and counters: a scripted model that asks for one tool call per step,
//! an observer that counts commits, and the medians and summary lines of their comparisons.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::{
    Model, ModelError, ModelRequest, ModelResponse, MoveInfo, MoveObserver, ToolCall, async_trait,
};
use serde_json::{Value, json};

/// Asks for the tool `tool` `steps` times, then answers: one step is one model call and one
/// tool call. Records, per run, the time between its model calls: the step latency.
#[derive(Clone)]
pub struct LoopModel {
    steps: u32,
    tool: &'static str,
    last: Arc<Mutex<HashMap<String, Instant>>>,
    pub latencies: Arc<Mutex<Vec<Duration>>>,
}

impl LoopModel {
    pub fn new(steps: u32, tool: &'static str) -> Self {
        LoopModel {
            steps,
            tool,
            last: Arc::default(),
            latencies: Arc::default(),
        }
    }

    /// The step latency (in ms) at percentiles `p50` and `p99` of the steps so far, and
    /// forgets them.
    pub fn take_p50_p99(&self) -> (f64, f64) {
        let mut latencies: Vec<f64> = std::mem::take(&mut *self.latencies.lock().unwrap())
            .iter()
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize];
        (pct(0.5), pct(0.99))
    }
}

#[async_trait(?Send)]
impl Model for LoopModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let now = Instant::now();
        if let Some(before) = self
            .last
            .lock()
            .unwrap()
            .insert(request.run_id.to_string(), now)
        {
            self.latencies.lock().unwrap().push(now - before);
        }
        // Each turn is a model step and one tool step: turn t is step 2t + 1.
        let turn = (request.step - 1) / 2;
        Ok(if turn < self.steps {
            ModelResponse::calls(vec![ToolCall::new(
                format!("c{turn}"),
                self.tool,
                json!({}),
            )])
        } else {
            ModelResponse::answer("done")
        })
    }
}

/// Counts committed transactions and the moves they made durable.
#[derive(Clone, Default)]
pub struct Commits {
    pub transactions: Arc<AtomicUsize>,
    pub moves: Arc<AtomicUsize>,
}

impl MoveObserver for Commits {
    fn committed(&self, moves: &[&MoveInfo]) {
        self.transactions.fetch_add(1, Ordering::Relaxed);
        self.moves.fetch_add(moves.len(), Ordering::Relaxed);
    }
}

impl Commits {
    /// (commits, moves) per step.
    pub fn per_step(&self, steps: usize) -> (f64, f64) {
        (
            self.transactions.load(Ordering::SeqCst) as f64 / steps as f64,
            self.moves.load(Ordering::SeqCst) as f64 / steps as f64,
        )
    }
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// Prints a comparison's summary line: the median, lowest and highest of its rounds' ratios.
pub fn summary(name: &str, extra: Value, ratios: &mut [f64]) {
    let (min, max) = (
        ratios.iter().cloned().fold(f64::MAX, f64::min),
        ratios.iter().cloned().fold(0.0, f64::max),
    );
    let mut line = json!({ "summary": name, "median_ratio": median(ratios), "min_ratio": min, "max_ratio": max, "rounds": ratios.len() });
    line.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    println!("{line}");
}
