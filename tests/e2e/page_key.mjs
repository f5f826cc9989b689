// The live page against `kvserve serve --api-key KEY` in headless Chromium,
// driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
// messages ending in NUL on fds 3 and 4), so no npm package is needed. The page
// loads without the key, asks for it after the first 401, then sends it as a
// header on every fetch and keeps it in sessionStorage across a reload.
// usage: node page_key.mjs CHROMIUM URL KEY PROFILE_DIR   (exit 1 on a failed check)
import {spawn} from 'node:child_process';

const [chrome, url, key, profile] = process.argv.slice(2);
const browser = spawn(chrome, ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage',
  `--user-data-dir=${profile}`, '--remote-debugging-pipe', 'about:blank'],
{stdio: ['ignore', 'ignore', 'ignore', 'pipe', 'pipe']});
const [toChrome, fromChrome] = [browser.stdio[3], browser.stdio[4]];
const pending = new Map();
let lastId = 0, buf = '';
fromChrome.on('data', (d) => {
  buf += d;
  for (let i; (i = buf.indexOf('\0')) >= 0; buf = buf.slice(i + 1)) {
    const msg = JSON.parse(buf.slice(0, i));
    if (msg.id && pending.has(msg.id)) {
      pending.get(msg.id)(msg);
      pending.delete(msg.id);
    }
  }
});
const send = (method, params = {}, sessionId = undefined) => new Promise((resolve) => {
  const id = ++lastId;
  pending.set(id, resolve);
  toChrome.write(JSON.stringify({id, method, params, sessionId}) + '\0');
});
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const timer = setTimeout(() => { console.log('FAIL page_key.mjs timed out'); browser.kill(); process.exit(1); }, 60000);

const {result: {targetId}} = await send('Target.createTarget', {url: 'about:blank'});
const {result: {sessionId}} = await send('Target.attachToTarget', {targetId, flatten: true});
const evaluate = async (expression) =>
  (await send('Runtime.evaluate', {expression, returnByValue: true}, sessionId)).result?.result?.value;
const waitFor = async (expression, ms = 15000) => {
  for (const end = Date.now() + ms; Date.now() < end; await sleep(100))
    if (await evaluate(expression)) return true;
  return false;
};
let fail = 0;
const check = (ok, what) => { console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}`); fail |= !ok; };
const polls = "+(document.getElementById('grid') || {dataset: {}}).dataset.polls";
const formShown = "!!document.getElementById('keyform') && !document.getElementById('keyform').hidden";

await send('Page.navigate', {url}, sessionId);
check(await waitFor(formShown), 'with --api-key the page loads without the key and asks for it after a 401');
check(await evaluate(polls) === 0, 'no data drawn without the key');
await evaluate(`document.getElementById('key').value = ${JSON.stringify(key)};
  document.getElementById('keyform').requestSubmit(); true`);
check(await waitFor(`${polls} >= 2`), 'after the key is given the page polls /cache/usage with it');
check(await evaluate('location.search') === '' && await evaluate(`!(${formShown})`),
  'the key is not in the URL and the form is gone');
check(await evaluate("sessionStorage.getItem('kvserve-api-key')") === key, 'the key is kept in sessionStorage');
await evaluate('window.beforeReload = true');
await send('Page.reload', {}, sessionId);
check(await waitFor(`!window.beforeReload && ${polls} >= 1`) && await evaluate(`!(${formShown})`),
  'after a reload the page uses the kept key');
clearTimeout(timer);
browser.kill();
process.exit(fail);
