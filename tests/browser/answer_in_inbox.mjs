// The operator follows a parent run to the child it waits for, answers the child's question
// in the inbox (after two answers the page or the API refuses), and watches both runs finish.
import assert from "node:assert/strict";
import { env, main, text, timeline, untilEvent, untilText, useToken } from "./lib.mjs";

const parentId = env("AGENTRT_RUN_ID");
const childId = env("AGENTRT_CHILD_ID");
const question = env("AGENTRT_QUESTION");

await main(async ({ page, url, screenshot }) => {
  // The parent waits for its child, which its page links to.
  await page.goto(`${url}#/runs/${encodeURIComponent(parentId)}`);
  await untilText(page, "run-state", "WAITING_FOR_CHILD");
  assert.match(await text(page, "run-wait-what"), /^Its child run .* \(agent booker\) since /);
  await page.getByTestId("run-wait-child").click();

  // The child names its parent, and says what it waits for.
  await untilText(page, "run-id", childId);
  await untilText(page, "run-state", "WAITING_FOR_ANSWER");
  assert.equal(await text(page, "run-parent"), parentId);
  assert.equal(await text(page, "run-wait-question"), question);
  assert.deepEqual(JSON.parse(await text(page, "run-wait-schema")).required, ["account"]);
  await screenshot("child-waits");
  await page.getByTestId("run-wait-answer").click();

  // The inbox lists the question beside the (no) approvals.
  const item = page.locator(`[data-testid="question"][data-run-id="${childId}"]`);
  await item.waitFor();
  assert.equal(await item.getByTestId("question-text").innerText(), question);
  assert.equal(JSON.parse(await item.getByTestId("question-schema").innerText()).type, "object");
  await page.getByTestId("approvals-empty").waitFor();
  await untilText(page, "approvals-count", "1");
  // An object is asked for: the answer goes as JSON unless told otherwise.
  assert.equal(await item.getByTestId("answer-as-json").isChecked(), true);

  await useToken(page, env("AGENTRT_CONSOLE_TOKEN"));
  await untilText(page, "operator", "Operator: alice");

  // JSON mistyped is refused by the page; an answer off the schema by the API.
  const input = item.getByTestId("answer-input");
  await input.fill('{"account": savings}');
  await item.getByTestId("answer-submit").click();
  await page.waitForFunction(() => document.querySelector('[data-testid="alert"]').dataset.code === "not_json");
  await input.fill('{"acct": "savings"}');
  await item.getByTestId("answer-submit").click();
  await page.waitForFunction(() => document.querySelector('[data-testid="alert"]').dataset.code === "invalid_answer");
  assert.match(await text(page, "alert-text"), /account/);
  await screenshot("refused");

  // Ctrl+Enter sends it.
  await input.fill('{"account": "savings"}');
  await input.press("Control+Enter");
  await page.getByTestId("status-run").waitFor();
  assert.match(await text(page, "status"), new RegExp(`Answered the question of run ${childId} \\(by alice\\)`));
  assert.equal(await page.getByTestId("alert").isVisible(), false);
  await item.waitFor({ state: "detached" });
  await page.getByTestId("questions-empty").waitFor();
  await untilText(page, "approvals-count", "");

  // The child goes on with the answer, then its end wakes the parent.
  await page.getByTestId("status-run").click();
  await untilEvent(page, "run.finished");
  await untilText(page, "run-state", "SUCCEEDED");
  const kinds = (await timeline(page)).map((e) => e.kind);
  for (const kind of ["run.waiting", "wait.woken", "run.resumed", "step.tool_finished", "run.finished"]) {
    assert.ok(kinds.includes(kind), `the child's timeline shows ${kind}: ${kinds}`);
  }
  const woken = page.locator('[data-testid="timeline"] li[data-kind="wait.woken"]');
  assert.match(await woken.innerText(), /answered by alice/);
  assert.equal(await page.getByTestId("run-wait").isVisible(), false);
  await screenshot("child-finished");

  await page.getByTestId("run-parent").click();
  await untilText(page, "run-id", parentId);
  await untilText(page, "run-state", "SUCCEEDED");
  await untilText(page, "timeline-status", "ended: SUCCEEDED");
  assert.equal(await text(page, "run-output"), "trip planned");
  const parentKinds = (await timeline(page)).map((e) => e.kind);
  assert.ok(parentKinds.includes("wait.woken"), `the parent was woken: ${parentKinds}`);
  await screenshot("parent-finished");
});
