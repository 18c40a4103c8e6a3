// A run whose executor crashed shows its lease expired; the operator resumes it from its page
// and watches the takeover and the run's end.
import assert from "node:assert/strict";
import { env, main, reached, text, untilEvent, untilText, useToken } from "./lib.mjs";

const runId = env("AGENTRT_RUN_ID");

await main(async ({ page, url, screenshot }) => {
  await page.goto(`${url}#/runs/${encodeURIComponent(runId)}`);
  await untilText(page, "run-state", "RUNNING");
  await page.getByTestId("lease-expired").waitFor();
  assert.match(await text(page, "run-lease-owner"), /^crashed-host\//);
  await screenshot("expired");

  await useToken(page, env("AGENTRT_CONSOLE_TOKEN"));
  await untilText(page, "operator", "Operator: alice");
  await page.getByTestId("resume").click();
  await untilEvent(page, "lease.taken_over");
  await untilEvent(page, "step.reconciled");
  // The lease changed hands, and is live.
  await page.waitForFunction(() => {
    const owner = document.querySelector('[data-testid="run-lease-owner"]').textContent;
    return owner !== "none" && !owner.startsWith("crashed-host/") && !document.querySelector('[data-testid="lease-expired"]');
  });

  // The harness lets the tool's new attempt return now.
  reached("taken-over");

  await untilEvent(page, "run.finished");
  await untilText(page, "run-state", "SUCCEEDED");
  assert.equal(await page.getByTestId("lease-expired").count(), 0);
  assert.equal(await page.getByTestId("resume").isVisible(), false);
  const takeover = page.locator('[data-testid="timeline"] li[data-kind="lease.taken_over"]');
  assert.match(await takeover.innerText(), /from crashed-host\//);
  await screenshot("resumed");
});
