// Without a token, then with a wrong one, the console's writes are refused: the page shows the
// API's error and asks for a token, and nothing is decided or cancelled.
import assert from "node:assert/strict";
import { env, main, text, untilText, useToken } from "./lib.mjs";

const runId = env("AGENTRT_RUN_ID");

/** Does `action` with no alert showing, then waits for the page to show the API's 401. */
async function refused(page, action) {
  const alert = page.getByRole("alert");
  if (await alert.isVisible()) await page.getByTestId("alert-dismiss").click();
  await alert.waitFor({ state: "hidden" });
  await action();
  await alert.waitFor();
  assert.match(await alert.innerText(), /\(unauthorized\)/);
  await page.getByTestId("token-form").waitFor();
}

await main(async ({ page, url, screenshot }) => {
  await page.goto(`${url}#/approvals`);
  const call = page.locator(`[data-testid="approval"][data-run-id="${runId}"]`);
  await call.waitFor();
  await untilText(page, "operator", "No token: read only");

  await refused(page, () => call.getByTestId("approve").click());
  await screenshot("approve-refused");
  assert.equal(await call.getByTestId("approve").isEnabled(), true, "the call can be decided again");

  // A token that stops being valid while the page is open: the API refuses it as any other.
  await page.evaluate(() => sessionStorage.setItem("agentrt.token", "not-the-token"));
  await call.getByLabel("Note").fill("let it through");
  await refused(page, () => call.getByTestId("deny").click());
  assert.match(await page.getByRole("alert").innerText(), /not one of this API's/);

  // Given through the token box, a wrong token is refused for reads as well. The stale token
  // is dropped first: the page's own reads with it would raise the alert again in the
  // background, and the refusal looked for is the token box's.
  await page.evaluate(() => sessionStorage.removeItem("agentrt.token"));
  await refused(page, () => useToken(page, "still-not-the-token"));
  await untilText(page, "operator", "Token refused: read only");
  await page.getByTestId("token-forget").click();
  await untilText(page, "operator", "No token: read only");
  await page.goto(`${url}#/runs/${encodeURIComponent(runId)}`);
  await untilText(page, "run-state", "WAITING_FOR_APPROVAL");
  await page.getByTestId("cancel-open").click();
  await page.getByLabel("Reason").fill("no longer needed");
  await refused(page, () => page.getByTestId("cancel-confirm").click());
  await screenshot("cancel-refused");
  assert.equal(await text(page, "run-state"), "WAITING_FOR_APPROVAL");
});
