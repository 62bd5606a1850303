// The real E2B JS SDK against kvbox's envd (guest-agent/envd), run by
// TestSDKConformance in a network namespace of its own: node reaches
// nothing but that namespace's loopback, where the test serves envd on
// E2B_SANDBOX_URL and a small control plane on E2B_API_URL that hands out
// the one sandbox (its id, envdVersion and access token).
//
// Environment: E2B_SDK_DIR (the folder of one pinned install, testenv/e2b/V),
// KVBOX_SCRATCH (a folder the test made, envd's default workdir; every path
// used is under it), KVBOX_SANDBOX_ID, KVBOX_BAD_TOKEN_ID (a sandbox id the
// control plane answers with a wrong token; empty where envd checks none),
// KVBOX_ENV_FOO (the sandbox's
// FOO variable), KVBOX_HAS_USER (set where envd's machine has the user
// "user", as kvbox's images do).
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { createHash } from 'node:crypto'
import { pathToFileURL } from 'node:url'
import { readFileSync } from 'node:fs'

const sdkDir = process.env.E2B_SDK_DIR
const require = createRequire(sdkDir + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox, CommandExitError } = e2b
const sdkVersion = require('e2b/package.json').version
const scratch = process.env.KVBOX_SCRATCH
const sandboxId = process.env.KVBOX_SANDBOX_ID
const semver = sdkVersion.split('.').map(Number)
const atLeast = (...v) => {
  for (let i = 0; i < v.length; i++) {
    if (semver[i] !== v[i]) return semver[i] > v[i]
  }
  return true
}

// sdkHas says the SDK's code names what a feature sends (its option, its
// header): an SDK without it has no such feature to test.
const sdkSource = readFileSync(require.resolve('e2b'), 'utf8')
const sdkHas = (what) => sdkSource.includes(what)

// until polls cond (bounded), for what arrives asynchronously.
async function until(what, cond, tries = 200) {
  for (let i = 0; i < tries; i++) {
    if (await cond()) return
    await new Promise((r) => setTimeout(r, 50))
  }
  assert.fail(`${what}: not seen after ${tries} polls`)
}

const sbx = await Sandbox.create('base', { timeoutMs: 60_000 })
console.log(`# e2b ${sdkVersion}: sandbox ${sbx.sandboxId}`)

test('create answered by the control plane, envd healthy', async () => {
  assert.equal(sbx.sandboxId, sandboxId)
  assert.equal(await sbx.isRunning(), true)
})

test('commands.run: exit code, stdout and stderr', async () => {
  const r = await sbx.commands.run('echo hello; echo oops >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n')
  assert.equal(r.stderr, 'oops\n')
  await assert.rejects(sbx.commands.run('echo before; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError, String(err))
    assert.equal(err.exitCode, 3)
    assert.equal(err.stdout, 'before\n')
    return true
  })
})

test('commands.run streams output as it comes', async () => {
  const out = []
  const err = []
  // Each line waits until the test has seen the one before: streamed, not
  // delivered at the end. A fifo per line: a writer still closing one is
  // never taken for the next line's.
  const fifo = `${scratch}/stream.fifo`
  await sbx.commands.run(`mkfifo ${fifo}1 ${fifo}2 ${fifo}3`)
  const h = await sbx.commands.run(`for i in 1 2 3; do echo out$i; echo err$i >&2; read x < ${fifo}$i; done`, {
    background: true,
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  for (let i = 1; i <= 3; i++) {
    await until(`line ${i}`, () => out.join('').includes(`out${i}\n`) && err.join('').includes(`err${i}\n`))
    await sbx.commands.run(`echo go > ${fifo}${i}`)
  }
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(out.join(''), 'out1\nout2\nout3\n')
  assert.equal(err.join(''), 'err1\nerr2\nerr3\n')
})

test('environment: E2B variables, the sandbox\'s, the call\'s; cwd and user', async () => {
  const r = await sbx.commands.run('echo "$E2B_SANDBOX $E2B_SANDBOX_ID $FOO $BAR"; pwd; id -un', {
    envs: { BAR: 'bar' },
    cwd: scratch,
    user: 'root',
  })
  assert.equal(r.stdout, `true ${sandboxId} ${process.env.KVBOX_ENV_FOO} bar\n${scratch}\nroot\n`)
  const o = await sbx.commands.run('echo $FOO', { envs: { FOO: 'mine' } })
  assert.equal(o.stdout, 'mine\n', 'the call\'s variable replaces the sandbox\'s')
  await assert.rejects(sbx.commands.run('true', { user: 'no-such-user-kvbox' }))
})

test('the image\'s user "user"', { skip: !process.env.KVBOX_HAS_USER && 'no user "user" where this envd runs' }, async () => {
  const r = await sbx.commands.run('id -un; echo $HOME; pwd', { user: 'user', cwd: '/home/user' })
  assert.equal(r.stdout, 'user\n/home/user\n/home/user\n')
  const w = await sbx.files.write('notes.txt', 'mine', { user: 'user' })
  assert.equal(w.path, '/home/user/notes.txt', 'a relative path is under the user\'s home')
  assert.equal((await sbx.files.getInfo('/home/user/notes.txt')).owner, 'user')
  await sbx.files.remove('/home/user/notes.txt')
})

test('a background command: listed, reattached by pid, killed', async () => {
  const h = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.05; done', { background: true })
  assert.ok(h.pid > 0)
  let list = await sbx.commands.list()
  assert.ok(list.some((p) => p.pid === h.pid && p.cmd === '/bin/bash'), JSON.stringify(list))
  await h.disconnect()
  // The process outlives the stream that started it.
  const seen = []
  const again = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  await until('output after reattach', () => seen.join('').includes('tick'))
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(again.wait(), (err) => err instanceof CommandExitError && err.exitCode !== 0)
  list = await sbx.commands.list()
  assert.ok(!list.some((p) => p.pid === h.pid))
  assert.equal(await sbx.commands.kill(h.pid), false, 'a gone process is not found')
})

test('stdin: sendStdin and closeStdin', async () => {
  const h = await sbx.commands.run('cat; echo done', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'hello stdin\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'hello stdin\ndone\n')
})

test('the call\'s timeout ends the process, not only the stream', async () => {
  const marker = `${scratch}/timeout-marker`
  await assert.rejects(sbx.commands.run(`sleep 30; touch ${marker}`, { timeoutMs: 1000 }))
  await until('the timed-out process gone', async () => {
    const list = await sbx.commands.list()
    return !list.some((p) => (p.args || []).join(' ').includes('sleep 30'))
  })
  assert.equal(await sbx.files.exists(marker), false)
})

test('files: 0 bytes and 50 MB, written and read back', async () => {
  const empty = `${scratch}/files/empty`
  const info = await sbx.files.write(empty, '')
  assert.equal(info.path, empty)
  assert.equal(await sbx.files.read(empty), '')
  assert.equal((await sbx.files.read(empty, { format: 'bytes' })).length, 0)

  const big = new Uint8Array(50 * 1024 * 1024)
  for (let i = 0; i < big.length; i += 4096) big[i] = (i / 4096) & 0xff
  const want = createHash('sha256').update(big).digest('hex')
  let t0 = performance.now()
  await sbx.files.write(`${scratch}/files/big`, big.buffer)
  const up = performance.now() - t0
  t0 = performance.now()
  const got = await sbx.files.read(`${scratch}/files/big`, { format: 'bytes' })
  const down = performance.now() - t0
  console.log(`# e2b ${sdkVersion}: 50 MB write ${up.toFixed(0)} ms, read ${down.toFixed(0)} ms`)
  assert.equal(got.length, big.length)
  assert.equal(createHash('sha256').update(got).digest('hex'), want)
  const r = await sbx.commands.run(`sha256sum ${scratch}/files/big | cut -d' ' -f1`)
  assert.equal(r.stdout.trim(), want)
})

test('files: an octet-stream upload (a stream) and gzip', { skip: !atLeast(2, 19) && 'useOctetStream and gzip came after this SDK' }, async () => {
  const data = 'streamed '.repeat(100000)
  const stream = new Blob([data]).stream()
  await sbx.files.write(`${scratch}/files/streamed`, stream)
  assert.equal(await sbx.files.read(`${scratch}/files/streamed`), data)
  await sbx.files.write(`${scratch}/files/gz`, data, { gzip: true })
  assert.equal(await sbx.files.read(`${scratch}/files/gz`, { gzip: true }), data)
})

test('files: list, makeDir, rename, exists, getInfo, remove', async () => {
  const d = `${scratch}/tree`
  assert.equal(await sbx.files.makeDir(`${d}/a/b`), true)
  assert.equal(await sbx.files.makeDir(`${d}/a/b`), false, 'already there')
  await sbx.files.write(`${d}/a/one.txt`, 'one')
  await sbx.files.write(`${d}/a/b/two.txt`, 'two!')
  let l = await sbx.files.list(`${d}/a`)
  assert.deepEqual(l.map((e) => e.name).sort(), ['b', 'one.txt'])
  const one = l.find((e) => e.name === 'one.txt')
  assert.equal(one.type, 'file')
  assert.equal(one.path, `${d}/a/one.txt`)
  assert.equal(l.find((e) => e.name === 'b').type, 'dir')
  l = await sbx.files.list(`${d}/a`, { depth: 2 })
  assert.deepEqual(l.map((e) => e.path).sort(), [`${d}/a/b`, `${d}/a/b/two.txt`, `${d}/a/one.txt`])
  const moved = await sbx.files.rename(`${d}/a/one.txt`, `${d}/moved/one.txt`)
  assert.equal(moved.path, `${d}/moved/one.txt`)
  assert.equal(await sbx.files.exists(`${d}/a/one.txt`), false)
  assert.equal(await sbx.files.read(`${d}/moved/one.txt`), 'one')
  const gi = await sbx.files.getInfo(`${d}/a/b/two.txt`)
  assert.equal(gi.size, 4)
  assert.equal(gi.owner, 'root')
  await sbx.files.remove(`${d}/a`)
  assert.equal(await sbx.files.exists(`${d}/a`), false)
  await assert.rejects(sbx.files.read(`${d}/a/b/two.txt`), (err) => err.name === 'NotFoundError' || /not found|no such/i.test(String(err)))
})

test('watchDir sees a file made, then written in place', async () => {
  const d = `${scratch}/watched`
  await sbx.files.makeDir(d)
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e))
  await sbx.files.write(`${d}/new.txt`, 'x')
  await until('a create event', () => events.some((e) => e.name === 'new.txt' && e.type === 'create'))
  await until('a write event of the new file', () => events.some((e) => e.name === 'new.txt' && e.type === 'write'))
  const ino = (await sbx.commands.run(`ls -i ${d}/new.txt`)).stdout
  events.length = 0
  await sbx.files.write(`${d}/new.txt`, 'written again')
  await until('a write event of the file written again', () => events.some((e) => e.name === 'new.txt' && e.type === 'write'))
  // In place, as E2B's envd writes: the same file, no temporary beside it.
  assert.equal((await sbx.commands.run(`ls -i ${d}/new.txt`)).stdout, ino)
  assert.deepEqual([...new Set(events.map((e) => e.name))], ['new.txt'])
  assert.equal(await sbx.files.read(`${d}/new.txt`), 'written again')
  await h.stop()
})

// envd 0.6.3: entries in watch events; 0.6.4: network mounts refused unless
// allowed. The SDK refuses both itself for an older envd.
test('watchDir with includeEntry: each create, write and chmod carries its entry', { skip: !sdkHas('includeEntry') && 'this SDK has no includeEntry' }, async () => {
  const d = `${scratch}/watched-entries`
  await sbx.files.makeDir(d)
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e), { includeEntry: true })
  await sbx.files.write(`${d}/e.txt`, 'twelve bytes')
  await sbx.commands.run(`chmod 600 ${d}/e.txt`)
  await until('a chmod event with the new mode', () => events.some((e) => e.name === 'e.txt' && e.type === 'chmod' && e.entry?.mode === 0o600))
  await sbx.files.remove(`${d}/e.txt`)
  await until('a remove event', () => events.some((e) => e.name === 'e.txt' && e.type === 'remove'))
  await h.stop()
  const write = events.findLast((e) => e.type === 'write')
  assert.ok(write?.entry, JSON.stringify(events))
  assert.equal(write.entry.name, 'e.txt')
  assert.equal(write.entry.path, `${d}/e.txt`)
  assert.equal(write.entry.type, 'file')
  assert.equal(write.entry.size, 12)
  assert.ok(write.entry.modifiedTime instanceof Date)
  const chmod = events.find((e) => e.type === 'chmod' && e.entry?.mode === 0o600)
  assert.equal(chmod.entry.permissions, '-rw-------')
  assert.equal(events.find((e) => e.type === 'remove').entry, undefined)
  // A watch without includeEntry carries none.
  const plain = []
  const h2 = await sbx.files.watchDir(d, (e) => plain.push(e))
  await sbx.files.write(`${d}/p.txt`, 'p')
  await until('a write event', () => plain.some((e) => e.type === 'write'))
  await h2.stop()
  assert.ok(plain.every((e) => e.entry === undefined), JSON.stringify(plain))
})

// envd 0.6.2: file metadata, as extended attributes.
test('files.write with metadata: read back by getInfo, list and the write itself; replaced by the next write', { skip: !sdkHas('X-Metadata-') && 'this SDK has no file metadata' }, async () => {
  const f = `${scratch}/meta/m.txt`
  const info = await sbx.files.write(f, 'm', { metadata: { Owner: 'ci', job: '17' } })
  assert.deepEqual(info.metadata, { owner: 'ci', job: '17' })
  assert.deepEqual((await sbx.files.getInfo(f)).metadata, { owner: 'ci', job: '17' })
  assert.deepEqual((await sbx.files.list(`${scratch}/meta`)).find((e) => e.name === 'm.txt').metadata, { owner: 'ci', job: '17' })
  // As the file's extended attribute, where the machine has a tool to
  // read one (a busybox guest has none).
  const xa = await sbx.commands.run(`if command -v python3 >/dev/null; then python3 -c "import os,sys; sys.stdout.write(os.getxattr('${f}','user.e2b.job').decode())"; else echo no-tool; fi`)
  if (xa.stdout !== 'no-tool\n') assert.equal(xa.stdout, '17')
  await sbx.files.write(f, 'm2', { metadata: { job: '18' } })
  assert.deepEqual((await sbx.files.getInfo(f)).metadata, { job: '18' })
  await sbx.files.write(f, 'm3')
  assert.equal((await sbx.files.getInfo(f)).metadata, undefined)
  await assert.rejects(sbx.files.write(f, 'x', { metadata: { bad: 'caf\u00e9' } }), /printable/i)
})

test('pty: a shell on a terminal, resized, fed input', async () => {
  const chunks = []
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(dec.decode(d)) })
  await sbx.pty.resize(h.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('stty size; echo pty-$((40+2)); exit 7\n'))
  const r = await h.wait().catch((e) => e)
  const out = chunks.join('')
  assert.match(out, /30 100/)
  assert.match(out, /pty-42/)
  assert.equal(r.exitCode, 7)
})

test('signed URLs: upload and download without the token header', async () => {
  const path = `${scratch}/signed.txt`
  const up = await sbx.uploadUrl(path)
  assert.match(up, /signature=v1_/)
  const form = new FormData()
  form.append('file', new Blob(['signed body']), path)
  let res = await fetch(up, { method: 'POST', body: form })
  assert.equal(res.status, 200, await res.clone().text())
  res = await fetch(await sbx.downloadUrl(path))
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'signed body')
  if (process.env.KVBOX_BAD_TOKEN_ID) {
    // Where envd checks signatures itself (kvbox serve does on the host).
    const tampered = (await sbx.downloadUrl(path)).replace('signed.txt', 'other.txt')
    res = await fetch(tampered)
    assert.equal(res.status, 401)
  }
})

// Where envd checks tokens itself (its loopback door); through the agent
// channel kvbox serve checks them on the host (TestServe), and the stub
// then has no sandbox with a wrong one.
test('a wrong access token is refused', { skip: !process.env.KVBOX_BAD_TOKEN_ID && 'no token checks on this door' }, async () => {
  const bad = await Sandbox.connect(process.env.KVBOX_BAD_TOKEN_ID)
  await assert.rejects(bad.commands.run('true'), (err) => err.name === 'AuthenticationError')
  await assert.rejects(bad.files.read(`${scratch}/signed.txt`), (err) => err.name === 'AuthenticationError')
  await assert.rejects(bad.files.list(scratch), (err) => err.name === 'AuthenticationError')
})

test('command round trip', async () => {
  const n = 20
  const t0 = performance.now()
  for (let i = 0; i < n; i++) await sbx.commands.run('true')
  console.log(`# e2b ${sdkVersion}: commands.run('true') ${((performance.now() - t0) / n).toFixed(1)} ms each over ${n}`)
})
