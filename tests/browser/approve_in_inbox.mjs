// The operator approves a waiting call in the inbox, then watches the run finish.
import assert from "node:assert/strict";
import { env, main, text, timeline, untilEvent, untilText, useToken } from "./lib.mjs";

const runId = env("AGENTRT_RUN_ID");
const reason = env("AGENTRT_POLICY_REASON");

await main(async ({ page, url, screenshot }) => {
  // A second tab keeps the runs list open: it follows the store's changes by itself.
  const list = await page.context().newPage();
  await list.goto(`${url}#/runs`);
  const row = (state) => list.locator(`[data-testid="run-row"][data-run-id="${runId}"][data-state="${state}"]`);
  await row("WAITING_FOR_APPROVAL").waitFor();
  await untilText(list, "approvals-count", "1");
  await list.evaluate(() => { window.stillTheSamePage = true; });

  await page.goto(`${url}#/approvals`);
  const call = page.locator(`[data-testid="approval"][data-run-id="${runId}"]`);
  await call.waitFor();
  assert.equal(await call.getByTestId("approval-tool").innerText(), "transfer");
  assert.deepEqual(JSON.parse(await call.getByTestId("approval-args").innerText()), { amount: 100 });
  assert.match(await call.getByTestId("approval-reason").innerText(), new RegExp(reason));
  assert.equal(await text(page, "approvals-count"), "1");

  await useToken(page, env("AGENTRT_CONSOLE_TOKEN"));
  await untilText(page, "operator", "Operator: alice");
  await screenshot("inbox");

  await call.getByLabel("Note").fill("within budget");
  await call.getByTestId("approve").click();
  await page.getByTestId("status-run").waitFor();
  assert.match(await text(page, "status"), /Approved transfer .* \(by alice\)/);
  await call.waitFor({ state: "detached" });
  await page.getByTestId("approvals-empty").waitFor();

  await page.getByTestId("status-run").click();
  await untilEvent(page, "run.finished");
  await untilText(page, "run-state", "SUCCEEDED");
  await untilText(page, "timeline-status", "ended: SUCCEEDED");
  const kinds = (await timeline(page)).map((e) => e.kind);
  for (const kind of ["approval.recorded", "run.resumed", "step.tool_started", "step.tool_finished", "run.finished"]) {
    assert.ok(kinds.includes(kind), `the timeline shows ${kind}: ${kinds}`);
  }
  assert.ok(kinds.indexOf("step.tool_finished") < kinds.indexOf("run.finished"), String(kinds));
  const approval = page.locator('[data-testid="timeline"] li[data-kind="approval.recorded"]');
  assert.match(await approval.innerText(), /approved by alice: within budget/);
  assert.equal(await text(page, "run-output"), "finished");
  await screenshot("run-finished");

  await row("SUCCEEDED").waitFor();
  await untilText(list, "approvals-count", "");
  assert.equal(await list.evaluate(() => window.stillTheSamePage), true, "the list was not reloaded");
  await list.close();
});
