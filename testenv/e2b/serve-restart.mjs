// kvbox serve killed and started again in the middle (TestServe): with
// KVBOX_PHASE=before it makes a sandbox with a command running and files
// written, and one that times out while serve is down, and writes their
// ids to KVBOX_STATE_FILE; with KVBOX_PHASE=after it finds the first as it
// was (the command still running and counting) and the second gone.
// Environment as serve.test.mjs's.
import assert from 'node:assert/strict'
import { readFileSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox } = e2b
const opts = { requestTimeoutMs: 600_000 }
const file = process.env.KVBOX_STATE_FILE
const template = process.env.KVBOX_TEMPLATE

const read = async (s) => Number((await s.files.read('/tmp/counter')).trim())

if (process.env.KVBOX_PHASE === 'before') {
  const kept = await Sandbox.create(template, { ...opts, timeoutMs: 900_000, metadata: { restart: 'kept' } })
  // timeoutMs 0: no Connect-Timeout-Ms, which would bound the command's
  // life (envd's semantics) to less than the restart takes.
  const h = await kept.commands.run('i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.2; done', { background: true, timeoutMs: 0 })
  await kept.files.write('/home/user/note', 'written before the restart')
  const short = await Sandbox.create(template, { ...opts, timeoutMs: 10_000, metadata: { restart: 'short' } })
  await short.commands.run('true')
  for (let i = 0; i < 100 && (await read(kept)) < 3; i++) await new Promise((r) => setTimeout(r, 100))
  const count = await read(kept)
  const endAt = (await short.getInfo()).endAt.getTime()
  // Stop following the command (it runs on), or its open stream keeps
  // node from ending.
  await h.disconnect()
  writeFileSync(file, JSON.stringify({ kept: kept.sandboxId, token: kept.envdAccessToken, pid: h.pid, count, short: short.sandboxId, shortEnd: endAt }))
  console.log(`before the restart: ${kept.sandboxId} counting (${count}), ${short.sandboxId} times out at ${new Date(endAt).toISOString()}`)
} else {
  const st = JSON.parse(readFileSync(file, 'utf8'))
  const kept = await Sandbox.connect(st.kept, opts)
  assert.equal(kept.envdAccessToken, st.token, 'the same token after the restart')
  assert.equal(await kept.files.read('/home/user/note'), 'written before the restart')
  assert.ok((await kept.commands.list()).some((p) => p.pid === st.pid), 'the command still runs')
  const c1 = await read(kept)
  assert.ok(c1 > st.count, `the counter went on while serve was down: ${c1} after ${st.count}`)
  let c2 = c1
  for (let i = 0; i < 100 && c2 <= c1; i++) {
    await new Promise((r) => setTimeout(r, 100))
    c2 = await read(kept)
  }
  assert.ok(c2 > c1, 'the counter counts on')
  const listed = await Sandbox.list({ ...opts, query: { metadata: { restart: 'kept' } } }).nextItems()
  assert.deepEqual(listed.map((s) => s.sandboxId), [st.kept])
  await assert.rejects(Sandbox.connect(st.short, opts), (e) => e.name === (e2b.SandboxNotFoundError ? 'SandboxNotFoundError' : 'NotFoundError'), 'the sandbox that timed out while serve was down')
  assert.equal((await Sandbox.list({ ...opts, query: { metadata: { restart: 'short' } } }).nextItems()).length, 0)
  assert.equal(await Sandbox.kill(kept.sandboxId, opts), true)
  console.log(`after the restart: ${st.kept} counted on (${st.count} -> ${c2}), ${st.short} gone`)
}
