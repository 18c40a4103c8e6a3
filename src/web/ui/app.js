// The agentrt operator console: plain JavaScript, no build step, no request but the API's.
// It lives at `<scope>/ui/`; the API is the scope itself, so every path below is relative to
// `../` and any mount prefix works.
"use strict";

(() => {
  const API = new URL("../", location.href);
  const TOKEN_KEY = "agentrt.token";
  // Every run state, in the order of a run's life (RunState::ALL; a unit test keeps them equal).
  const STATES = ["RUNNING", "WAITING_FOR_APPROVAL", "WAITING_FOR_ANSWER", "WAITING_FOR_EVENT", "WAITING_FOR_TIMER", "WAITING_FOR_CHILD", "SUCCEEDED", "FAILED", "CANCELLED"];
  const FINISHED = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  const PAGE_SIZE = 50;
  /** At most this many questions are listed in the inbox, as the API lists approvals. */
  const INBOX_QUESTIONS = 200;

  const $ = (testid) => document.querySelector(`[data-testid="${testid}"]`);
  const view = document.getElementById("view");

  // ---- Small helpers ------------------------------------------------------------------

  /** Builds an element; attributes starting with `on` are listeners, children are nodes or text. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "text") el.textContent = value;
      else el.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  const pretty = (value) => JSON.stringify(value, null, 2);
  const query = (params) => { const q = params.toString(); return q ? `?${q}` : ""; };
  const enc = encodeURIComponent;
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  function time(ms) {
    if (ms === undefined || ms === null) return "—";
    const d = new Date(ms);
    const pad = (n, w = 2) => String(n).padStart(w, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  }

  function stateBadge(state, testid) {
    return h("span", { class: `state state-${String(state).toLowerCase()}`, "data-testid": testid }, state);
  }

  /** Calls `fn` once after a burst of calls has settled, and never twice at once. */
  function coalesce(fn, wait = 100) {
    let timer = null;
    let running = false;
    let again = false;
    const run = async () => {
      timer = null;
      if (running) { again = true; return; }
      running = true;
      try { await fn(); } finally {
        running = false;
        if (again) { again = false; schedule(); }
      }
    };
    const schedule = () => { if (timer === null) timer = setTimeout(run, wait); };
    schedule.cancel = () => { if (timer !== null) clearTimeout(timer); timer = null; again = false; };
    return schedule;
  }

  // ---- Alerts, status, token ----------------------------------------------------------

  function showError(error) {
    const code = error.code ? ` (${error.code})` : "";
    $("alert-text").textContent = `${error.message || String(error)}${code}`;
    $("alert").dataset.code = error.code || "";
    $("alert").hidden = false;
  }

  function clearError() {
    $("alert").hidden = true;
    $("alert-text").textContent = "";
  }

  /** Says what was done in the status region; `parts` are text or nodes (a link, say). */
  function say(...parts) {
    $("status").replaceChildren(...parts);
  }

  const token = {
    get: () => sessionStorage.getItem(TOKEN_KEY),
    set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
    clear: () => sessionStorage.removeItem(TOKEN_KEY),
  };

  function askForToken(why) {
    const form = $("token-form");
    $("token-why").textContent = why;
    form.hidden = false;
    $("token-input").focus();
  }

  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    token.set(value);
    $("token-input").value = "";
    $("token-form").hidden = true;
    clearError();
    restart();
  });
  $("token-forget").addEventListener("click", () => {
    token.clear();
    $("token-form").hidden = true;
    say("Token forgotten.");
    restart();
  });
  $("token-close").addEventListener("click", () => { $("token-form").hidden = true; });
  $("token-show").addEventListener("click", () => askForToken(
    token.get() ? "A token is in use for this tab. Enter another, or forget it." : "Enter a bearer token for writes."));
  $("alert-dismiss").addEventListener("click", clearError);

  // ---- The API ------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  function headers(extra) {
    const all = { ...extra };
    const t = token.get();
    if (t) all.Authorization = `Bearer ${t}`;
    return all;
  }

  /** The API's `{"error": {"code", "message"}}`, as an ApiError; a 401 asks for a token. */
  async function failure(response) {
    let body = null;
    try { body = await response.json(); } catch { /* not JSON: fall back on the status */ }
    const err = (body && body.error) || {};
    const error = new ApiError(response.status, err.code || `http_${response.status}`,
      err.message || `The API answered ${response.status} ${response.statusText}.`);
    if (response.status === 401) {
      askForToken(token.get() ? "The API refused the token: enter another." : "The API asks for a bearer token.");
    }
    return error;
  }

  async function request(method, path, body) {
    const init = { method, cache: "no-store", headers: headers({ Accept: "application/json" }) };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(new URL(path, API), init);
    } catch (e) {
      throw new ApiError(0, "network", `The API did not answer: ${e.message}`);
    }
    if (!response.ok) throw await failure(response);
    return response.status === 204 ? null : response.json();
  }

  const get = (path) => request("GET", path);
  const post = (path, body) => request("POST", path, body ?? {});

  // ---- Server-sent events over fetch ----------------------------------------------------
  // EventSource cannot send an Authorization header, so streams are read and parsed here.

  async function readEvents(path, { lastId, signal, onOpen, onEvent }) {
    const extra = { Accept: "text/event-stream" };
    if (lastId !== null && lastId !== undefined) extra["Last-Event-ID"] = String(lastId);
    const response = await fetch(new URL(path, API), { headers: headers(extra), signal, cache: "no-store" });
    if (!response.ok) throw await failure(response);
    onOpen();
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let event = { id: null, type: "", data: [] };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (event.data.length || event.type) {
            const stop = onEvent({ id: event.id, type: event.type || "message", data: event.data.join("\n") });
            if (stop) return;
          }
          event = { id: null, type: "", data: [] };
          continue;
        }
        if (line.startsWith(":")) continue; // a keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let data = colon < 0 ? "" : line.slice(colon + 1);
        if (data.startsWith(" ")) data = data.slice(1);
        if (field === "event") event.type = data;
        else if (field === "data") event.data.push(data);
        else if (field === "id") event.id = data;
      }
    }
  }

  /**
   * Follows a stream until stopped or until `onEvent` returns true, reconnecting with a
   * backoff (and `lastId()` as Last-Event-ID) when it drops. A 401 ends it: saving a token
   * restarts every stream.
   */
  function follow(path, { lastId = () => null, onEvent, onState = () => {} }) {
    let stopped = false;
    let controller = null;
    (async () => {
      let backoff = 250;
      while (!stopped) {
        controller = new AbortController();
        let finished = false;
        try {
          await readEvents(path, {
            lastId: lastId(),
            signal: controller.signal,
            onOpen: () => { backoff = 250; onState("live"); },
            onEvent: (e) => (finished = onEvent(e) === true),
          });
        } catch (e) {
          if (stopped || e.name === "AbortError") return;
          if (e instanceof ApiError && (e.status === 401 || e.status === 404)) {
            showError(e);
            onState("stopped");
            return;
          }
        }
        if (finished || stopped) return;
        onState("reconnecting");
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 8000);
      }
    })();
    return () => { stopped = true; if (controller) controller.abort(); };
  }

  // ---- Who is this ----------------------------------------------------------------------

  /** What `/whoami` said last; `executes` shows the resume button. */
  let me = { executes: false };

  async function whoami() {
    const el = $("operator");
    try {
      me = await get("whoami");
      if (current && current.onWhoami) current.onWhoami();
      el.dataset.operator = me.operator || "";
      if (me.authenticated) el.textContent = `Operator: ${me.operator}`;
      else if (me.tokens) el.textContent = token.get() ? "Token refused: read only" : "No token: read only";
      else el.textContent = "Local operator";
    } catch (e) {
      el.dataset.operator = "";
      el.textContent = token.get() ? "Token refused: read only" : "No token: read only";
      if (e.status !== 401) showError(e);
    }
  }

  /** What waits for an operator: the calls to decide, and the questions to answer. */
  async function inbox() {
    const [{ calls }, { waits }] = await Promise.all([
      get("approvals"), get(`waits?kind=answer&limit=${INBOX_QUESTIONS}`)]);
    // An answered question is on its way to its resume: nothing is left to answer.
    const questions = waits.filter((w) => w.woken_at == null);
    const n = calls.length + questions.length;
    $("approvals-count").textContent = n ? String(n) : "";
    return { calls, questions };
  }

  async function countInbox() {
    try { await inbox(); } catch { /* shown by the view that needs it */ }
  }

  // ---- Runs list ------------------------------------------------------------------------

  function runsView(params) {
    const state = params.get("state") || "";
    const agent = params.get("agent") || "";
    const after = params.get("after") || "";

    const stateSelect = h("select", { id: "filter-state", name: "state", "data-testid": "filter-state" },
      h("option", { value: "" }, "any"),
      STATES.map((s) => h("option", { value: s, selected: s === state }, s)));
    const agentInput = h("input", {
      id: "filter-agent", name: "agent", value: agent, "data-testid": "filter-agent",
      placeholder: "any", autocomplete: "off", spellcheck: "false",
    });
    const filters = h("form", {
      class: "filters", role: "search", "data-testid": "filters",
      onsubmit: (event) => {
        event.preventDefault();
        const q = new URLSearchParams();
        if (stateSelect.value) q.set("state", stateSelect.value);
        if (agentInput.value.trim()) q.set("agent", agentInput.value.trim());
        location.hash = `#/runs${query(q)}`;
      },
    },
    h("label", { for: "filter-state" }, "State"), stateSelect,
    h("label", { for: "filter-agent" }, "Agent ", h("kbd", {}, "/")), agentInput,
    h("button", { type: "submit", "data-testid": "filter-apply" }, "Filter"));
    stateSelect.addEventListener("change", () => filters.requestSubmit());

    const body = h("tbody", { "data-testid": "runs" });
    const paging = h("nav", { class: "paging", "aria-label": "Pages" });
    view.append(
      h("h1", {}, "Runs"),
      filters,
      h("table", { class: "runs" },
        h("thead", {}, h("tr", {}, ["Run", "Agent", "State", "Created", "Updated"].map((c) => h("th", { scope: "col" }, c)))),
        body),
      paging);

    const link = (extra) => {
      const q = new URLSearchParams();
      if (state) q.set("state", state);
      if (agent) q.set("agent", agent);
      for (const [k, v] of Object.entries(extra)) q.set(k, v);
      return `#/runs${query(q)}`;
    };

    async function load() {
      const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
      if (state) q.set("state", state);
      if (agent) q.set("agent", agent);
      if (after) q.set("after", after);
      let page;
      try {
        page = await get(`runs?${q}`);
      } catch (e) {
        showError(e);
        return;
      }
      // A refresh keeps the keyboard's place: the focused run's link is focused again.
      const focused = document.activeElement && document.activeElement.closest("tr[data-run-id]");
      const refocus = focused && body.contains(focused) ? focused.dataset.runId : null;
      body.replaceChildren(...page.runs.map((run) => h("tr", {
        "data-testid": "run-row", "data-run-id": run.id, "data-state": run.state,
      },
      h("td", {}, h("a", { href: `#/runs/${enc(run.id)}`, class: "mono" }, run.id)),
      h("td", {}, run.agent),
      h("td", {}, stateBadge(run.state)),
      h("td", {}, time(run.created_at)),
      h("td", {}, time(run.updated_at)))));
      if (refocus !== null) {
        const row = [...body.querySelectorAll("tr[data-run-id]")].find((tr) => tr.dataset.runId === refocus);
        if (row) row.querySelector("a").focus();
      }
      if (!page.runs.length) {
        body.append(h("tr", {}, h("td", { colspan: 5, class: "empty", "data-testid": "runs-empty" },
          after ? "No more runs." : "No runs.")));
      }
      paging.replaceChildren(
        after ? h("a", { href: link({}), "data-testid": "first-page" }, "First page") : "",
        page.next ? h("a", { href: link({ after: page.next }), "data-testid": "next-page", rel: "next" }, "Next page") : "");
    }

    const reload = coalesce(load);
    load();
    return { onChanged: reload, cleanup: reload.cancel };
  }

  // ---- One run --------------------------------------------------------------------------

  function summary(event) {
    const p = event.payload || {};
    switch (event.kind) {
      case "run.started": return `agent ${p.agent}${p.queued ? ", queued" : ""}`;
      case "run.forked": return `from ${p.origin} at step ${p.at}`;
      case "run.finished": return [p.state, p.output ?? p.error].filter((x) => x !== undefined).join(": ");
      case "policy.decided": return [p.decision, p.tool, p.reason].filter(Boolean).join(" · ");
      case "run.waiting": return [p.tool, p.call_id, p.waits_for && `waits for ${p.waits_for}: ${p.key}`].filter(Boolean).join(" · ");
      case "wait.woken": return p.waits_for === "answer" ? `answered by ${p.answered_by}`
        : p.waits_for === "event" ? `event ${p.name} (${p.event_id})`
          : p.waits_for === "child" ? `child ${p.child} ${p.state}` : "";
      case "event.received": return `${p.name} (${p.event_id})${p.kept ? ", kept for a later wait" : ""}`;
      case "run.resumed": return p.from ? `from ${p.from}` : "";
      case "approval.recorded": return `${p.approved ? "approved" : "denied"} by ${p.decided_by}${p.note ? `: ${p.note}` : ""}`;
      case "step.tool_started": return `${p.tool} ${JSON.stringify(p.args)}`;
      case "step.tool_finished": return p.error !== undefined ? `error: ${p.error}` : `output ${JSON.stringify(p.output)}`;
      case "step.model_finished": return p.error !== undefined ? `error: ${p.error}`
        : p.tool_calls && p.tool_calls.length ? `calls ${p.tool_calls.map((c) => c.name).join(", ")}` : (p.text ?? "");
      case "lease.taken_over": return `from ${p.previous_owner ?? "?"} to ${p.new_owner ?? "?"}`;
      default: return "";
    }
  }

  function field(label, value, testid) {
    return [h("dt", {}, label), h("dd", { "data-testid": testid }, value)];
  }

  function runView(id) {
    const details = h("dl", { class: "details", "data-testid": "run-details" });
    const pending = h("section", { class: "pending", "data-testid": "run-pending", hidden: true });
    const waiting = h("section", { class: "pending", "data-testid": "run-wait", hidden: true });
    const timeline = h("ol", { class: "timeline", "data-testid": "timeline" });
    const streamState = h("span", { class: "stream", "data-testid": "timeline-status" }, "connecting");
    const actions = h("div", { class: "actions" });
    let run = null;
    let lastSeq = 0;
    let shownExpired = false;
    /** The run that delegated this one, from its `run.started` event: `{run_id, step, call_id}`. */
    let parent = null;

    const cancelReason = h("input", { id: "cancel-reason", "data-testid": "cancel-reason", required: true, autocomplete: "off" });
    const cancelForm = h("form", {
      class: "inline", "data-testid": "cancel-form", hidden: true,
      onsubmit: async (event) => {
        event.preventDefault();
        try {
          await post(`runs/${enc(id)}/cancel`, { reason: cancelReason.value.trim() });
          cancelForm.hidden = true;
          clearError();
          say(`Run ${id} cancelled.`);
          loadRun();
        } catch (e) { showError(e); }
      },
    },
    h("label", { for: "cancel-reason" }, "Reason"), cancelReason,
    h("button", { type: "submit", class: "danger", "data-testid": "cancel-confirm" }, "Cancel run"),
    h("button", { type: "button", onclick: () => { cancelForm.hidden = true; } }, "Keep it"));

    const forkAt = h("input", { id: "fork-at", type: "number", min: 1, step: 1, required: true, "data-testid": "fork-at" });
    const forkId = h("input", { id: "fork-new-id", "data-testid": "fork-new-id", placeholder: "random", autocomplete: "off" });
    const forkForm = h("form", {
      class: "inline", "data-testid": "fork-form", hidden: true,
      onsubmit: async (event) => {
        event.preventDefault();
        const body = { at: Number(forkAt.value) };
        if (forkId.value.trim()) body.new_id = forkId.value.trim();
        try {
          const { run_id } = await post(`runs/${enc(id)}/fork`, body);
          clearError();
          say(`Forked ${id} at step ${body.at} as ${run_id}.`);
          location.hash = `#/runs/${enc(run_id)}`;
        } catch (e) { showError(e); }
      },
    },
    h("label", { for: "fork-at" }, "At step"), forkAt,
    h("label", { for: "fork-new-id" }, "New id"), forkId,
    h("button", { type: "submit", "data-testid": "fork-confirm" }, "Fork"),
    h("button", { type: "button", onclick: () => { forkForm.hidden = true; } }, "Close"));

    const cancelOpen = h("button", {
      type: "button", class: "danger", "data-testid": "cancel-open",
      onclick: () => { forkForm.hidden = true; cancelForm.hidden = false; cancelReason.focus(); },
    }, "Cancel…");
    const forkOpen = h("button", {
      type: "button", "data-testid": "fork-open",
      onclick: () => { cancelForm.hidden = true; forkForm.hidden = false; forkAt.focus(); },
    }, "Fork…");
    // Shown for a run nobody executes now (its lease lapsed or was never taken), when the
    // API has a supervisor to execute it.
    const resume = h("button", {
      type: "button", "data-testid": "resume", hidden: true,
      onclick: async () => {
        try {
          await post(`runs/${enc(id)}/resume`);
          clearError();
          say(`Run ${id} resumed.`);
          loadRun();
        } catch (e) { showError(e); }
      },
    }, "Resume");
    actions.append(resume, cancelOpen, forkOpen);

    view.append(
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), " / "),
      h("h1", { class: "mono", "data-testid": "run-id" }, id),
      details, actions, cancelForm, forkForm, pending, waiting,
      h("h2", {}, "Timeline ", streamState),
      timeline);

    function leaseExpired() {
      return Boolean(run && run.lease && (run.lease_expired || run.lease.expires_at <= Date.now()));
    }

    function renderDetails() {
      const lease = run.lease;
      shownExpired = leaseExpired();
      const u = run.usage;
      const usage = u
        ? `${u.input_tokens ?? 0} in / ${u.output_tokens ?? 0} out tokens · ${u.answers ?? 0} answers` +
          ` of ${u.attempts ?? 0} attempts${u.models && u.models.length ? ` · ${u.models.join(", ")}` : ""}`
        : "—";
      details.replaceChildren(
        ...field("State", stateBadge(run.state), "run-state"),
        ...field("Agent", run.agent, "run-agent"),
        ...(parent ? field("Parent", [
          h("a", { href: `#/runs/${enc(parent.run_id)}`, class: "mono", "data-testid": "run-parent" }, parent.run_id),
          ` (step ${parent.step}, call `, h("span", { class: "mono" }, parent.call_id), ")"], "run-parent-field") : []),
        ...field("Created", time(run.created_at), "run-created"),
        ...field("Updated", time(run.updated_at), "run-updated"),
        ...field("Lease holder", lease ? h("span", { class: "mono" }, lease.owner) : "none", "run-lease-owner"),
        ...field("Lease expires", lease
          ? [time(lease.expires_at), leaseExpired() ? h("span", { class: "tag warn", "data-testid": "lease-expired" }, "expired") : ""]
          : "—", "run-lease-expires"),
        ...field("Fencing token", lease ? String(lease.fencing_token) : "—", "run-fencing-token"),
        ...field("Usage", usage, "run-usage"),
        ...field("Input", h("pre", {}, pretty(run.input)), "run-input"),
        ...(run.output !== null && run.output !== undefined ? field("Output", h("pre", {}, run.output), "run-output") : []),
        ...(run.error !== null && run.error !== undefined ? field("Error", h("pre", { class: "error" }, run.error), "run-error") : []));
      const finished = FINISHED.has(run.state);
      cancelOpen.disabled = finished;
      resume.hidden = !(me.executes && run.state === "RUNNING" && (!run.lease || leaseExpired()));
      if (finished) cancelForm.hidden = true;

      const calls = run.pending_calls || [];
      pending.hidden = calls.length === 0;
      pending.replaceChildren(
        h("h2", {}, "Waiting for a decision"),
        h("ul", {}, calls.map((c) => h("li", { "data-testid": "run-pending-call", "data-call-id": c.call_id },
          h("strong", {}, c.tool), ` (step ${c.step}, ${c.reason}) `,
          h("a", { href: "#/approvals" }, "decide in the inbox"),
          h("pre", {}, pretty(c.args))))));
      renderWait(run.wait);
    }

    /** What the run waits for other than an approval, and since when. */
    function renderWait(w) {
      waiting.hidden = !w;
      if (!w) { waiting.replaceChildren(); return; }
      const since = ` since ${time(w.since)}`;
      const d = w.detail || {};
      let what;
      switch (w.kind) {
        case "answer": what = [`An answer to its question${since}: `,
          h("strong", { "data-testid": "run-wait-question" }, d.question ?? ""), " ",
          h("a", { href: "#/approvals", "data-testid": "run-wait-answer" }, "answer in the inbox")];
          break;
        case "event": what = ["An event named ", h("strong", { class: "mono" }, w.key), since];
          break;
        case "timer": what = [`Its time, ${time(w.due_at)}`, w.key ? ` (${w.key})` : "", since,
          d.retry ? "; the call is made again then" : ""];
          break;
        case "child": what = ["Its child run ",
          h("a", { href: `#/runs/${enc(w.key)}`, class: "mono", "data-testid": "run-wait-child" }, w.key),
          d.agent ? ` (agent ${d.agent})` : "", since];
          break;
        default: what = [`${w.kind}${since}`];
      }
      waiting.dataset.kind = w.kind;
      waiting.replaceChildren(h("h2", {}, "Waiting for"), h("p", { "data-testid": "run-wait-what" }, ...what),
        w.kind === "answer" && d.schema ? h("pre", { "data-testid": "run-wait-schema" }, pretty(d.schema)) : "");
    }

    async function loadRun() {
      try {
        run = await get(`runs/${enc(id)}`);
        renderDetails();
      } catch (e) {
        showError(e);
      }
    }

    function append(event) {
      if (event.seq <= lastSeq) return;
      lastSeq = event.seq;
      if (event.kind === "run.started" && event.payload && event.payload.parent) {
        parent = event.payload.parent;
        if (run) renderDetails();
      }
      const text = summary(event);
      timeline.append(h("li", { "data-testid": "event", "data-kind": event.kind, "data-seq": event.seq },
        h("details", {},
          h("summary", {},
            h("span", { class: "seq" }, `#${event.seq}`), " ",
            h("time", { datetime: new Date(event.at).toISOString() }, time(event.at)), " ",
            h("span", { class: "kind", "data-testid": "event-kind" }, event.kind),
            event.step !== null && event.step !== undefined ? h("span", { class: "step" }, ` step ${event.step}`) : "",
            text ? h("span", { class: "what" }, ` ${text}`) : ""),
          h("pre", {}, pretty(event.payload)))));
    }

    const reloadRun = coalesce(loadRun);
    const stopStream = follow(`runs/${enc(id)}/events/stream`, {
      lastId: () => (lastSeq ? lastSeq : null),
      onState: (s) => { if (!streamState.dataset.end) streamState.textContent = s; },
      onEvent: (e) => {
        if (e.type === "end") {
          let state = "";
          try { state = JSON.parse(e.data).state; } catch { /* keep it empty */ }
          streamState.dataset.end = state;
          streamState.textContent = `ended: ${state}`;
          reloadRun();
          return true;
        }
        if (e.type === "message" || !e.data) return false;
        try { append(JSON.parse(e.data)); } catch { return false; }
        reloadRun();
        return false;
      },
    });
    // The lease's "expired" flag follows the clock between refreshes.
    const ticker = setInterval(() => { if (run && run.lease) renderDetailsIfExpiryChanged(); }, 1000);
    function renderDetailsIfExpiryChanged() {
      const now = leaseExpired();
      if (now !== shownExpired) { shownExpired = now; renderDetails(); }
    }

    loadRun();
    return {
      onChanged: reloadRun,
      onWhoami: () => { if (run) renderDetails(); },
      cleanup: () => { stopStream(); reloadRun.cancel(); clearInterval(ticker); },
    };
  }

  // ---- Inbox: approvals and questions ---------------------------------------------------

  /** What a list's item is kept under: its run and call. */
  const keyOf = (entry) => `${entry.run_id}\u0000${entry.call_id}`;

  /**
   * Makes `list` show one item per entry, in order: items are kept across refreshes (in
   * `items`, by key) and moved only when out of order, so text being typed keeps its text and
   * its focus through a `changed` event; `make` builds a new entry's item.
   */
  function sync(list, items, entries, make) {
    const keep = new Set(entries.map(keyOf));
    for (const [key, li] of items) {
      if (keep.has(key)) continue;
      // The keyboard moves on to the next item when the focused one is done.
      if (li.contains(document.activeElement)) {
        let next = li.nextElementSibling;
        while (next && !keep.has(keyOf({ run_id: next.dataset.runId, call_id: next.dataset.callId }))) next = next.nextElementSibling;
        (next || view).focus();
      }
      li.remove();
      items.delete(key);
    }
    let at = list.firstElementChild;
    for (const entry of entries) {
      const key = keyOf(entry);
      if (!items.has(key)) items.set(key, make(entry));
      const li = items.get(key);
      if (li === at) at = at.nextElementSibling;
      else list.insertBefore(li, at);
    }
  }

  function approvalsView() {
    const list = h("ul", { class: "inbox", "data-testid": "approvals" });
    const empty = h("p", { class: "empty", "data-testid": "approvals-empty", hidden: true }, "Nothing waits for a decision.");
    const questionList = h("ul", { class: "inbox", "data-testid": "questions" });
    const noQuestions = h("p", { class: "empty", "data-testid": "questions-empty", hidden: true }, "No run waits for an answer.");
    view.append(h("h1", {}, "Inbox"),
      h("h2", {}, "Approvals"),
      h("p", { class: "hint" }, "Focus a call and press ", h("kbd", {}, "a"), " to approve or ", h("kbd", {}, "d"), " to deny."),
      empty, list,
      h("h2", {}, "Questions"),
      h("p", { class: "hint" }, "Answer in JSON, or as text, sent as a JSON string; ", h("kbd", {}, "Ctrl"), "+", h("kbd", {}, "Enter"), " sends."),
      noQuestions, questionList);
    const items = new Map();
    const questionItems = new Map();
    let serial = 0;

    function item(call) {
      const noteId = `note-${++serial}`;
      const note = h("input", { id: noteId, "data-testid": "approval-note", autocomplete: "off" });
      const decide = async (approved) => {
        const verb = approved ? "approve" : "deny";
        for (const b of li.querySelectorAll("button")) b.disabled = true;
        const body = note.value.trim() ? { note: note.value.trim() } : {};
        try {
          const approval = await post(`runs/${enc(call.run_id)}/calls/${enc(call.call_id)}/${verb}`, body);
          clearError();
          say(`${approval.approved ? "Approved" : "Denied"} ${call.tool} on run `,
            h("a", { href: `#/runs/${enc(call.run_id)}`, class: "mono", "data-testid": "status-run" }, call.run_id),
            ` (by ${approval.by}).`);
          li.dataset.decided = verb;
          load();
        } catch (e) {
          showError(e);
          for (const b of li.querySelectorAll("button")) b.disabled = false;
        }
      };
      const approve = h("button", { type: "button", class: "approve", "data-testid": "approve", onclick: () => decide(true) }, "Approve");
      const deny = h("button", { type: "button", class: "danger", "data-testid": "deny", onclick: () => decide(false) }, "Deny");
      const li = h("li", {
        tabindex: 0, "data-testid": "approval", "data-run-id": call.run_id, "data-call-id": call.call_id,
        "aria-label": `${call.tool} on run ${call.run_id}`,
        onkeydown: (event) => {
          if (event.target !== li || event.ctrlKey || event.metaKey || event.altKey) return;
          if (event.key === "a") { event.preventDefault(); approve.click(); }
          if (event.key === "d") { event.preventDefault(); deny.click(); }
        },
      },
      h("h2", { "data-testid": "approval-tool" }, call.tool),
      h("p", { class: "meta" },
        "Run ", h("a", { href: `#/runs/${enc(call.run_id)}`, class: "mono", "data-testid": "approval-run" }, call.run_id),
        ` · agent ${call.agent} · step ${call.step} · call `, h("span", { class: "mono" }, call.call_id),
        ` · waiting since ${time(call.waiting_since)}`),
      h("p", { class: "reason", "data-testid": "approval-reason" },
        h("span", { class: "tag" }, call.reason), " ", call.policy_reason || (call.reason === "reconcile"
          ? "An interrupted attempt may or may not have taken effect: run it again?" : "")),
      h("pre", { "data-testid": "approval-args" }, pretty(call.args)),
      h("div", { class: "decide" }, h("label", { for: noteId }, "Note"), note, approve, deny));
      return li;
    }

    /** A run's question (its wait for an answer), with a form to answer it. */
    function question(wait) {
      const id = `answer-${++serial}`;
      const d = wait.detail || {};
      // A question whose schema wants a string is answered in text; any other in JSON.
      const textual = !d.schema || d.schema.type === "string";
      const input = h("textarea", {
        id, rows: 3, required: false, autocomplete: "off", spellcheck: "false", "data-testid": "answer-input",
        onkeydown: (event) => {
          if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); form.requestSubmit(); }
        },
      });
      const asJson = h("input", { type: "radio", name: `${id}-as`, id: `${id}-json`, value: "json", checked: !textual, "data-testid": "answer-as-json" });
      const asText = h("input", { type: "radio", name: `${id}-as`, id: `${id}-text`, value: "text", checked: textual, "data-testid": "answer-as-text" });
      const send = h("button", { type: "submit", class: "approve", "data-testid": "answer-submit" }, "Answer");
      const form = h("form", {
        class: "answer",
        onsubmit: async (event) => {
          event.preventDefault();
          let answer = input.value;
          if (asJson.checked) {
            try {
              answer = JSON.parse(input.value);
            } catch (e) {
              showError(new ApiError(0, "not_json", `The answer is not JSON (${e.message}): fix it, or send it as text.`));
              input.focus();
              return;
            }
          }
          send.disabled = true;
          try {
            const answered = await post(`runs/${enc(wait.run_id)}/calls/${enc(wait.call_id)}/answer`, { answer });
            clearError();
            say("Answered the question of run ",
              h("a", { href: `#/runs/${enc(wait.run_id)}`, class: "mono", "data-testid": "status-run" }, wait.run_id),
              ` (by ${answered.by}).`);
            // Listed until its run resumes: a supervisor that watches the store does it.
            li.dataset.answered = "true";
            input.disabled = true;
            load();
          } catch (e) {
            showError(e);
            send.disabled = false;
          }
        },
      },
      h("label", { for: id }, "Answer"), input,
      h("span", { class: "as", role: "radiogroup", "aria-label": "Send the answer as" },
        asJson, h("label", { for: `${id}-json` }, "JSON"), asText, h("label", { for: `${id}-text` }, "Text")),
      send);
      const li = h("li", {
        tabindex: 0, "data-testid": "question", "data-run-id": wait.run_id, "data-call-id": wait.call_id,
        "aria-label": `The question of run ${wait.run_id}`,
      },
      h("h2", { "data-testid": "question-text" }, d.question ?? wait.key),
      h("p", { class: "meta" },
        "Run ", h("a", { href: `#/runs/${enc(wait.run_id)}`, class: "mono", "data-testid": "question-run" }, wait.run_id),
        ` · step ${wait.step} · call `, h("span", { class: "mono" }, wait.call_id),
        ` · waiting since ${time(wait.since)}`),
      d.schema ? h("details", { open: true }, h("summary", {}, "Schema of the answer"),
        h("pre", { "data-testid": "question-schema" }, pretty(d.schema))) : "",
      form);
      return li;
    }

    async function load() {
      let found;
      try {
        found = await inbox();
      } catch (e) {
        showError(e);
        return;
      }
      sync(list, items, found.calls, item);
      empty.hidden = found.calls.length > 0;
      sync(questionList, questionItems, found.questions, question);
      noQuestions.hidden = found.questions.length > 0;
    }

    const reload = coalesce(load);
    load();
    return { onChanged: reload, cleanup: reload.cancel };
  }

  // ---- Routing and the store's change stream --------------------------------------------

  let current = null;
  let stopChanges = null;

  function route() {
    if (current) current.cleanup();
    view.replaceChildren();
    const [path, query] = (location.hash || "#/runs").slice(1).split("?");
    const parts = path.split("/").filter(Boolean);
    const params = new URLSearchParams(query || "");
    let active = "runs";
    if (parts[0] === "runs" && parts.length > 1) current = runView(decodeURIComponent(parts[1]));
    else if (parts[0] === "approvals") { current = approvalsView(); active = "approvals"; }
    else current = runsView(params);
    for (const name of ["runs", "approvals"]) {
      const a = $(`nav-${name}`);
      if (name === active) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
    }
  }

  function restart() {
    whoami();
    countInbox();
    if (stopChanges) stopChanges();
    const counted = coalesce(countInbox);
    let opened = false;
    stopChanges = follow("stream", {
      // After a reconnect, catch up on what changed while the stream was down.
      onState: (s) => { if (s === "live" && opened && current) current.onChanged(); if (s === "live") opened = true; },
      onEvent: (e) => {
        if (e.type === "changed") {
          if (current) current.onChanged();
          counted();
        }
        return false;
      },
    });
    route();
  }

  document.addEventListener("keydown", (event) => {
    const typing = event.target.closest && event.target.closest("input, textarea, select, [contenteditable]");
    if (event.key === "/" && !typing && !event.ctrlKey && !event.metaKey && !event.altKey) {
      const filter = document.getElementById("filter-agent");
      if (filter) { event.preventDefault(); filter.focus(); filter.select(); }
    }
  });
  window.addEventListener("hashchange", route);
  restart();
})();
