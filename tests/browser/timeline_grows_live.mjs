// A run's page, opened while the run is blocked in a tool, shows its later events as they are
// written, with no reload.
import assert from "node:assert/strict";
import { env, main, reached, text, timeline, untilEvent, untilText } from "./lib.mjs";

const runId = env("AGENTRT_RUN_ID");

await main(async ({ page, url, screenshot }) => {
  await page.goto(`${url}#/runs/${encodeURIComponent(runId)}`);
  await untilEvent(page, "step.tool_started");
  await untilText(page, "run-state", "RUNNING");
  assert.notEqual(await text(page, "run-lease-owner"), "none", "a running run shows its lease holder");
  assert.match(await text(page, "run-fencing-token"), /^[1-9][0-9]*$/);
  const before = await timeline(page);
  assert.ok(!before.some((e) => e.kind === "run.finished"), "the run is still blocked");
  await page.evaluate(() => { window.stillTheSamePage = true; });
  await screenshot("blocked");

  // The harness lets the tool return now.
  reached("blocked-seen");

  await untilEvent(page, "run.finished");
  await untilText(page, "run-state", "SUCCEEDED");
  await untilText(page, "timeline-status", "ended: SUCCEEDED");
  assert.equal(await page.evaluate(() => window.stillTheSamePage), true, "the page was not reloaded");
  const after = await timeline(page);
  assert.deepEqual(after.map((e) => e.seq), after.map((_, i) => i + 1), "each event once, in order");
  assert.deepEqual(after.slice(0, before.length), before, "the first events stayed");
  assert.ok(after.findIndex((e) => e.kind === "step.tool_finished") >= before.length, "the tool's outcome arrived live");
  assert.equal(await text(page, "run-lease-owner"), "none", "a finished run holds no lease");
  await screenshot("finished");
});
