// Shared by the console's browser tests: Debian's Chromium driven by playwright-core, the
// harness's settings from the environment, and a check that the page asked nothing of any
// other origin. tests/web/console_browser.rs runs these scripts; each exits 0 when its checks pass.
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

/** How long one wait for the page may take before the script fails. */
export const WAIT_MS = 20_000;

// A script that hangs fails instead, so the harness that waits for it never hangs.
setTimeout(() => {
  console.error("the browser script did not finish within 120 s");
  process.exit(3);
}, 120_000).unref();

/** A variable the harness must set. */
export function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set: run this script through tests/web/console_browser.rs`);
  return value;
}

/** Tells the harness that the page reached `name`: one line it reads from our stdout. */
export function reached(name) {
  console.log(`@@${name}`);
}

/**
 * Launches Chromium on a fresh profile and opens a page; `close()` checks that every request
 * went to the console's own origin, then tears the browser down.
 */
export async function open() {
  const console_url = new URL(env("AGENTRT_CONSOLE_URL"));
  const shots = env("AGENTRT_SCREENSHOTS");
  mkdirSync(shots, { recursive: true });
  const profile = mkdtempSync(join(tmpdir(), "agentrt-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    viewport: { width: 1200, height: 800 },
    // The machine's network is closed: without these, Chromium keeps dialing out.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  context.setDefaultTimeout(WAIT_MS);
  const page = context.pages()[0] ?? (await context.newPage());
  const elsewhere = [];
  const pageErrors = [];
  page.on("request", (request) => {
    const url = new URL(request.url());
    if (url.protocol !== "data:" && url.origin !== console_url.origin) elsewhere.push(request.url());
  });
  page.on("console", (message) => console.log(`[page ${message.type()}] ${message.text()}`));
  page.on("pageerror", (error) => {
    console.log(`[page error] ${error.stack || error}`);
    pageErrors.push(error);
  });
  let shot = 0;
  return {
    page,
    url: console_url.href,
    /** Saves a screenshot of the page as it is, numbered in the order taken. */
    async screenshot(name) {
      shot += 1;
      await page.screenshot({ path: join(shots, `${String(shot).padStart(2, "0")}-${name}.png`) });
    },
    async close() {
      await context.close();
      rmSync(profile, { recursive: true, force: true });
      assert.deepEqual(elsewhere, [], "the console asked another origin for something");
      assert.deepEqual(pageErrors.map(String), [], "the console's script threw");
    },
  };
}

/** The trimmed text of the element with this `data-testid` (the first, when several). */
export async function text(page, testid) {
  return (await page.getByTestId(testid).first().innerText()).trim();
}

/** Waits until the element with this `data-testid` says `expected`. */
export async function untilText(page, testid, expected) {
  await page.waitForFunction(
    ([id, want]) => document.querySelector(`[data-testid="${id}"]`)?.textContent.trim() === want,
    [testid, expected],
    { timeout: WAIT_MS },
  );
}

/** Waits until the run's timeline shows an event of `kind`. */
export async function untilEvent(page, kind) {
  await page.locator(`[data-testid="timeline"] li[data-kind="${kind}"]`).first().waitFor();
}

/** The kinds in the timeline, in order, and their sequence numbers. */
export async function timeline(page) {
  return page.$$eval('[data-testid="timeline"] li', (items) =>
    items.map((li) => ({ seq: Number(li.dataset.seq), kind: li.dataset.kind })));
}

/** Gives the console a bearer token through its token box. */
export async function useToken(page, token) {
  if (!(await page.getByTestId("token-form").isVisible())) await page.getByTestId("token-show").click();
  await page.getByLabel("Bearer token").fill(token);
  await page.getByTestId("token-save").click();
}

/**
 * Opens the console's browser, runs `body` with it, and closes it; on a failure, saves a
 * screenshot of where the page was, prints the error and exits non-zero.
 */
export async function main(body) {
  let session = null;
  try {
    session = await open();
    await body(session);
    await session.close();
  } catch (error) {
    console.error(error.stack || String(error));
    if (session) {
      await session.screenshot("failure").catch(() => {});
      await session.page.context().close().catch(() => {});
    }
    process.exit(1);
  }
}
