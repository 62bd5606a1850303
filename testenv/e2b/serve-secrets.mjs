// What a snapshot copies must open nothing: run by TestServe's "secrets"
// step (testenv/serve_e2e_test.go) with the real E2B JS SDK, in two phases.
//
// KVBOX_PHASE=make: a sandbox with envVars that has used its token (a
// command, a file written, a signed download URL fetched), a snapshot of it
// (createSnapshot), a fork where the SDK has fork, and a sandbox made from
// the snapshot; their ids and tokens go to KVBOX_STATE_FILE for the test,
// which then looks for the source's token in every blob and tries every
// token it finds in the clone against serve.
// KVBOX_PHASE=after: each sandbox's own SDK handle still works, with the
// source's files, then all go.
//
// Environment: as serve.test.mjs, plus KVBOX_PHASE and KVBOX_STATE_FILE.
import assert from 'node:assert/strict'
import fs from 'node:fs'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox } = e2b
const opts = { requestTimeoutMs: 600_000 }
const stateFile = process.env.KVBOX_STATE_FILE
const hold = (s) => ({ id: s.sandboxId, token: s.envdAccessToken })

if (process.env.KVBOX_PHASE === 'make') {
  const src = await Sandbox.create(process.env.KVBOX_TEMPLATE, {
    ...opts, timeoutMs: 900_000, envs: { SOURCE_SECRET: 'kept-by-the-source' },
  })
  assert.equal((await src.commands.run('echo $SOURCE_SECRET')).stdout, 'kept-by-the-source\n')
  await src.files.write('/home/user/source.txt', 'the source wrote this')
  const url = await src.downloadUrl('/home/user/source.txt', { useSignatureExpiration: 600_000 })
  const got = await fetch(url)
  assert.equal(await got.text(), 'the source wrote this')
  const snap = await src.createSnapshot(opts)
  let fork = null
  if (typeof src.fork === 'function') {
    const forks = await src.fork({ ...opts, count: 1, timeoutMs: 900_000 })
    assert.ok(!(forks[0] instanceof Error), `fork: ${forks[0]}`)
    fork = hold(forks[0])
  }
  const clone = await Sandbox.create(snap.snapshotId, { ...opts, timeoutMs: 900_000 })
  fs.writeFileSync(stateFile, JSON.stringify({ source: hold(src), clone: hold(clone), fork, snapshot: snap.snapshotId, signedURL: url }))
  console.log(`# source ${src.sandboxId}, snapshot ${snap.snapshotId}, clone ${clone.sandboxId}, fork ${fork && fork.id}`)
} else {
  const st = JSON.parse(fs.readFileSync(stateFile, 'utf8'))
  const all = [st.source, st.clone, st.fork].filter(Boolean)
  for (const h of all) {
    const s = await Sandbox.connect(h.id, opts)
    // A fork keeps its source's variables; a sandbox made from the
    // template has its own create's (none here), though the template's
    // files and memory are the source's.
    const want = h === st.clone ? '' : 'kept-by-the-source'
    const r = await s.commands.run('hostname; echo $SOURCE_SECRET')
    assert.equal(r.stdout, `${h.id}\n${want}\n`, `sandbox ${h.id}'s own handle`)
    assert.equal(await s.files.read('/home/user/source.txt'), 'the source wrote this')
  }
  for (const h of all) await Sandbox.kill(h.id, opts)
  await Sandbox.deleteSnapshot(st.snapshot, opts)
}
