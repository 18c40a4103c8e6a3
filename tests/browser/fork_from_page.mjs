// The operator forks a finished run at its first step from the run's page, and lands on the
// fork, which the API's supervisor executes.
import assert from "node:assert/strict";
import { env, main, untilEvent, untilText, useToken } from "./lib.mjs";

const runId = env("AGENTRT_RUN_ID");

await main(async ({ page, url, screenshot }) => {
  await page.goto(`${url}#/runs/${encodeURIComponent(runId)}`);
  await untilText(page, "timeline-status", "ended: SUCCEEDED");
  await useToken(page, env("AGENTRT_CONSOLE_TOKEN"));
  await untilText(page, "operator", "Operator: alice");

  await page.getByTestId("fork-open").click();
  await page.getByLabel("At step").fill("1");
  await page.getByLabel("New id").fill("fork-of-summary");
  await page.getByTestId("fork-confirm").click();

  await untilText(page, "run-id", "fork-of-summary");
  await page.waitForFunction(() => location.hash === "#/runs/fork-of-summary");
  await untilEvent(page, "run.forked");
  const forked = page.locator('[data-testid="timeline"] li[data-kind="run.forked"]');
  assert.match(await forked.innerText(), new RegExp(`from ${runId} at step 1`));
  await untilEvent(page, "run.finished");
  await untilText(page, "run-state", "SUCCEEDED");
  await screenshot("fork");
});
