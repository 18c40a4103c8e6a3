// Renders the runs list for the docs (docs/console.png), signed in as the harness's operator.
import { env, main, untilText, useToken } from "./lib.mjs";

await main(async ({ page, url }) => {
  await page.emulateMedia({ colorScheme: "light" });
  await page.goto(`${url}#/runs`);
  await useToken(page, env("AGENTRT_CONSOLE_TOKEN"));
  await untilText(page, "operator", `Operator: alice`);
  await page.waitForFunction(() => document.querySelectorAll('[data-testid="run-row"]').length === 6);
  // A call to approve and a question to answer.
  await untilText(page, "approvals-count", "2");
  await page.evaluate(() => document.activeElement?.blur());
  await page.screenshot({ path: env("AGENTRT_DOCS_SCREENSHOT") });
});
