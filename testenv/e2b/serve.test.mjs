// The real E2B JS SDK against `kvbox serve`, run by TestServe (testenv) in
// the kvbox-test namespace: every call the issue lists, on warm clones of a
// Debian template whose HTTP server (port 8000) was started before its
// snapshot.
//
// Environment: E2B_SDK_DIR (one pinned install, testenv/e2b/V), E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY (kvbox serve's), KVBOX_TEMPLATE (the
// template), KVBOX_SERVE_ADDR (host:port of kvbox serve, for getHost URLs),
// KVBOX_TEMPLATE_PAGE (what the template's server answers on /).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { createRequire } from 'node:module'
import { createHash } from 'node:crypto'
import { pathToFileURL } from 'node:url'
import { readFileSync } from 'node:fs'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox, CommandExitError } = e2b
const sdkVersion = require('e2b/package.json').version
const [major, minor] = sdkVersion.split('.').map(Number)
const atLeast = (ma, mi) => major > ma || (major === ma && minor >= mi)
// sdkHas says the SDK's code names what a feature sends (an option, a
// header): an SDK without it has no such feature to test.
const sdkSource = readFileSync(require.resolve('e2b'), 'utf8')
const sdkHas = (what) => sdkSource.includes(what)
const template = process.env.KVBOX_TEMPLATE
const [serveHost, servePort] = process.env.KVBOX_SERVE_ADDR.split(':')
// Clones under emulation on a shared 2-core machine take seconds each; ten
// at once queue behind each other.
const opts = { requestTimeoutMs: 600_000 }
const made = []
after(async () => {
  await Promise.all(made.map((s) => s.kill().catch(() => {})))
})

async function create(o = {}) {
  const s = await Sandbox.create(template, { timeoutMs: 900_000, ...opts, ...o })
  made.push(s)
  return s
}

// until polls cond (bounded), for what arrives asynchronously.
// counting counts in /tmp/counter, a file replaced whole each time: a
// read never sees it truncated and not yet written.
const counting = 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.2; done'
const readCounter = async (x) => Number((await x.files.read('/tmp/counter')).trim())

async function until(what, cond, tries = 600, every = 100) {
  for (let i = 0; i < tries; i++) {
    if (await cond()) return
    await new Promise((r) => setTimeout(r, every))
  }
  assert.fail(`${what}: not seen after ${tries} polls`)
}

// hostGet fetches getHost(port)'s URL the way a browser would: to kvbox
// serve, with the Host getHost names.
function hostGet(sbx, port, path = '/') {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: serveHost, port: servePort, path, headers: { Host: sbx.getHost(port) } }, (res) => {
      let body = ''
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
  })
}

// Older SDKs (2.14.1) throw NotFoundError for a sandbox that is gone,
// newer ones its subclass SandboxNotFoundError.
const sandboxNotFound = e2b.SandboxNotFoundError ? 'SandboxNotFoundError' : 'NotFoundError'
// kill: the instance's returns nothing in older SDKs; the static one says
// whether there was a sandbox to kill in every version.
const kill = (s) => Sandbox.kill(s.sandboxId, opts)

const rejectsWith = (p, name, what) =>
  assert.rejects(p, (err) => {
    assert.equal(err.name, name, `${what}: ${err}`)
    return true
  })

console.log(`# e2b ${sdkVersion} against kvbox serve, template ${template}`)
const sbx = await create({ metadata: { suite: 'serve', sdk: sdkVersion }, envs: { FOO: 'from-create' } })

test('create: a warm clone whose envd answers at once, with the template\'s server running', async () => {
  const r = await sbx.commands.run('echo "$FOO $E2B_SANDBOX_ID"; id -un; hostname')
  assert.equal(r.stdout, `from-create ${sbx.sandboxId}\nuser\n${sbx.sandboxId}\n`)
  assert.match(sbx.sandboxId, /^[a-z0-9]{20}$/)
  const page = await hostGet(sbx, 8000)
  assert.equal(page.status, 200)
  assert.equal(page.body, process.env.KVBOX_TEMPLATE_PAGE)
  const closed = await hostGet(sbx, 8001)
  assert.equal(closed.status, 502)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: 'serve', sdk: sdkVersion })
  assert.ok(info.endAt > info.startedAt)
  assert.equal(await sbx.isRunning(), true)
})

test('commands.run: output streamed as it comes, exit codes', async () => {
  const out = []
  const err = []
  const fifo = `/tmp/stream-${sdkVersion}.fifo`
  await sbx.commands.run(`mkfifo ${fifo}1 ${fifo}2 ${fifo}3`)
  const h = await sbx.commands.run(`for i in 1 2 3; do echo out$i; echo err$i >&2; read x < ${fifo}$i; done; exit 4`, {
    background: true,
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  for (let i = 1; i <= 3; i++) {
    await until(`line ${i}`, () => out.join('').includes(`out${i}\n`) && err.join('').includes(`err${i}\n`))
    await sbx.commands.run(`echo go > ${fifo}${i}`)
  }
  await assert.rejects(h.wait(), (e) => e instanceof CommandExitError && e.exitCode === 4)
  assert.equal(out.join(''), 'out1\nout2\nout3\n')
  const ok = await sbx.commands.run('true')
  assert.equal(ok.exitCode, 0)
})

test('a background command, reattached by pid and killed', async () => {
  const h = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done', { background: true })
  await h.disconnect()
  assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
  const seen = []
  const again = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  await until('output after reattaching', () => seen.join('').includes('tick'))
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(again.wait(), (e) => e instanceof CommandExitError)
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid))
})

test('files of 0 bytes and of 50 MB', async () => {
  await sbx.files.write('/home/user/empty', '')
  assert.equal(await sbx.files.read('/home/user/empty'), '')
  const big = new Uint8Array(50 * 1024 * 1024)
  for (let i = 0; i < big.length; i += 1000) big[i] = (i / 1000) & 0xff
  const want = createHash('sha256').update(big).digest('hex')
  let t0 = performance.now()
  await sbx.files.write('/home/user/big', big.buffer)
  const up = performance.now() - t0
  t0 = performance.now()
  const got = await sbx.files.read('/home/user/big', { format: 'bytes' })
  console.log(`# e2b ${sdkVersion}: 50 MB written in ${up.toFixed(0)} ms, read in ${(performance.now() - t0).toFixed(0)} ms`)
  assert.equal(createHash('sha256').update(got).digest('hex'), want)
  const r = await sbx.commands.run('sha256sum /home/user/big | cut -d" " -f1; stat -c %U /home/user/big')
  assert.equal(r.stdout, `${want}\nuser\n`)
  const names = (await sbx.files.list('/home/user')).map((e) => e.name)
  assert.ok(names.includes('big') && names.includes('empty'), names.join(' '))
  await sbx.files.remove('/home/user/big')
  assert.equal(await sbx.files.exists('/home/user/big'), false)
})

test('a PTY and a directory watch through kvbox serve', async () => {
  const chunks = []
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(dec.decode(d)) })
  await sbx.pty.resize(h.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('stty size; echo pty-$((40+2)); exit 7\n'))
  const r = await h.wait().catch((e) => e)
  assert.match(chunks.join(''), /30 100/)
  assert.match(chunks.join(''), /pty-42/)
  assert.equal(r.exitCode, 7)
  const dir = `/home/user/watched-${sdkVersion}`
  await sbx.files.makeDir(dir)
  const events = []
  const entries = sdkHas('includeEntry') ? { includeEntry: true } : {}
  const w = await sbx.files.watchDir(dir, (e) => events.push(e), entries)
  await sbx.files.write(`${dir}/new.txt`, 'x')
  await until('a create event', () => events.some((e) => e.name === 'new.txt' && e.type === 'create'))
  // Written in place, as E2B's envd writes: a write of the file itself,
  // and another when it is written again; no other name.
  await until('a write event', () => events.some((e) => e.name === 'new.txt' && e.type === 'write'))
  events.length = 0
  await sbx.files.write(`${dir}/new.txt`, 'written again')
  await until('a write event of the file written again', () => events.some((e) => e.name === 'new.txt' && e.type === 'write' && (!entries.includeEntry || e.entry?.size === 13)))
  assert.deepEqual([...new Set(events.map((e) => e.name))], ['new.txt'])
  await w.stop()
})

test('file metadata: written with the file, read back, replaced by the next write', { skip: !sdkHas('X-Metadata-') && `e2b ${sdkVersion} has no file metadata` }, async () => {
  const f = `/home/user/meta-${sdkVersion}.txt`
  const info = await sbx.files.write(f, 'm', { metadata: { Owner: 'ci', job: '17' } })
  assert.deepEqual(info.metadata, { owner: 'ci', job: '17' })
  assert.deepEqual((await sbx.files.getInfo(f)).metadata, { owner: 'ci', job: '17' })
  await sbx.files.write(f, 'm2')
  assert.equal((await sbx.files.getInfo(f)).metadata, undefined)
})

test('list: by metadata and by state', async () => {
  const other = await create({ metadata: { suite: 'serve', other: 'yes' } })
  const mine = await Sandbox.list({ ...opts, query: { metadata: { suite: 'serve', sdk: sdkVersion } } }).nextItems()
  assert.deepEqual(mine.map((s) => s.sandboxId), [sbx.sandboxId])
  const both = await Sandbox.list({ ...opts, query: { metadata: { suite: 'serve' } } }).nextItems()
  assert.ok(both.some((s) => s.sandboxId === other.sandboxId) && both.some((s) => s.sandboxId === sbx.sandboxId))
  const paused = await Sandbox.list({ ...opts, query: { state: ['paused'], metadata: { suite: 'serve' } } }).nextItems()
  assert.ok(!paused.some((s) => s.sandboxId === other.sandboxId))
  await other.kill()
})

test('setTimeout moves the deadline; connect only extends it', async () => {
  await sbx.setTimeout(1_200_000)
  const a = (await sbx.getInfo()).endAt
  await Sandbox.connect(sbx.sandboxId, { ...opts, timeoutMs: 60_000 })
  const b = (await sbx.getInfo()).endAt
  assert.equal(b.getTime(), a.getTime(), 'connect with a shorter timeout shortened the deadline')
  await sbx.setTimeout(900_000)
  const c = (await sbx.getInfo()).endAt
  assert.ok(c < a, 'setTimeout did not shorten the deadline')
})

test('pause: the sandbox is paused, answers nothing, and after connect its counter counts on', async () => {
  const s = await create()
  await s.commands.run(counting, { background: true })
  await until('the counter', async () => (await readCounter(s).catch(() => 0)) > 3)
  const before = await readCounter(s)
  assert.equal(await s.pause(), true)
  const listed = await Sandbox.list({ ...opts, query: { state: ['paused'] } }).nextItems()
  assert.ok(listed.some((x) => x.sandboxId === s.sandboxId && x.state === 'paused'))
  await assert.rejects(s.commands.run('true'), /paused/i)
  assert.equal(await s.pause(), false, 'pausing a paused sandbox')
  const again = await Sandbox.connect(s.sandboxId, opts)
  const resumed = await readCounter(again)
  assert.ok(resumed >= before, `${resumed} < ${before}`)
  await until('the counter counting on', async () => (await readCounter(again)) > resumed + 3)
})

test('pause with keepMemory false: the disk kept, not the memory; connect boots it cold with the same id', { skip: !sdkHas('keepMemory') && `e2b ${sdkVersion} has no keepMemory` }, async () => {
  const s = await create()
  await s.files.write('/home/user/kept.txt', 'on the disk')
  await s.commands.run('sync')
  await s.commands.run('sleep 100000', { background: true })
  assert.equal((await hostGet(s, 8000)).status, 200, 'the template\'s server, before')
  assert.equal(await s.pause({ ...opts, keepMemory: false }), true)
  assert.equal((await s.getInfo()).state, 'paused')
  assert.equal(await s.isRunning(), false)
  await assert.rejects(s.commands.run('true'), /paused/i)
  assert.equal(await s.pause({ ...opts, keepMemory: false }), false, 'pausing a paused sandbox')
  const again = await Sandbox.connect(s.sandboxId, opts)
  assert.equal(again.sandboxId, s.sandboxId)
  assert.equal(await again.files.read('/home/user/kept.txt'), 'on the disk')
  const r = await again.commands.run("hostname; pgrep -xf 'sleep 100000' || echo none")
  assert.equal(r.stdout, `${s.sandboxId}\nnone\n`, 'booted cold: nothing that ran runs')
  // The template's server ran in the memory only.
  assert.equal((await hostGet(again, 8000)).status, 502)
  await again.kill()
})

test('two kills at once: one removes the sandbox, the other finds it gone; a kill beside a pause', async () => {
  const s = await create()
  const both = await Promise.all([Sandbox.kill(s.sandboxId, opts), Sandbox.kill(s.sandboxId, opts)])
  assert.deepEqual(both.sort(), [false, true])
  const p = await create()
  const [paused, killed] = await Promise.allSettled([p.pause(opts), Sandbox.kill(p.sandboxId, opts)])
  assert.equal(killed.status, 'fulfilled')
  assert.equal(killed.value, true)
  // The pause ran first (true), or found the sandbox killed.
  assert.ok(paused.status === 'fulfilled' ? paused.value === true : /not found/i.test(String(paused.reason)), String(paused.reason ?? paused.value))
  assert.equal(await Sandbox.kill(p.sandboxId, opts), false)
})

test('lifecycle onTimeout pause with autoResume: paused at its timeout, resumed by the next request', async () => {
  const s = await create({ timeoutMs: 20_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
  const info = await s.getInfo()
  if (info.lifecycle) assert.deepEqual({ ...info.lifecycle }, { onTimeout: 'pause', autoResume: true })
  await s.commands.run(counting, { background: true })
  // Paused by its timeout (the box's reaper, not serve): listed as paused.
  await until('paused at its timeout', async () => {
    const l = await Sandbox.list({ ...opts, query: { state: ['paused'] } }).nextItems()
    return l.some((x) => x.sandboxId === s.sandboxId)
  }, 600, 500)
  // The next request resumes it, with its timeout again.
  const n = await readCounter(s)
  assert.ok(n > 0)
  assert.equal((await s.getInfo()).state, 'running')
  await until('the counter counting on', async () => (await readCounter(s)) > n + 3)
  await s.kill()
})

test('createSnapshot: a template, listed, that a sandbox starts from', async () => {
  await sbx.files.write('/home/user/before-snapshot', 'kept')
  const snap = await sbx.createSnapshot(opts)
  assert.ok(snap.snapshotId)
  const listed = await Sandbox.listSnapshots({ ...opts, sandboxId: sbx.sandboxId }).nextItems()
  assert.ok(listed.some((x) => x.snapshotId === snap.snapshotId))
  const child = await Sandbox.create(snap.snapshotId, { ...opts, timeoutMs: 300_000 })
  made.push(child)
  assert.equal(await child.files.read('/home/user/before-snapshot'), 'kept')
  assert.equal(await sbx.isRunning(), true, 'the sandbox runs on')
  await child.kill()
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, opts), false)
})

test('fork of 3: each its own sandbox with the source\'s state', { skip: typeof Sandbox.fork !== 'function' && `e2b ${sdkVersion} has no fork` }, async () => {
  await sbx.files.write('/home/user/before-fork', 'forked')
  const forks = await sbx.fork({ ...opts, count: 3, timeoutMs: 300_000 })
  assert.equal(forks.length, 3)
  const ids = new Set([sbx.sandboxId])
  for (const f of forks) {
    assert.ok(f instanceof Sandbox, String(f))
    made.push(f)
    ids.add(f.sandboxId)
    const r = await f.commands.run('cat /home/user/before-fork; echo; hostname')
    assert.equal(r.stdout, `forked\n${f.sandboxId}\n`)
  }
  assert.equal(ids.size, 4)
  await Promise.all(forks.map((f) => f.kill()))
})

test('10 creates at once', async () => {
  const t0 = performance.now()
  const all = await Promise.all(Array.from({ length: 10 }, () => create({ timeoutMs: 300_000 })))
  console.log(`# e2b ${sdkVersion}: 10 creates at once in ${(performance.now() - t0).toFixed(0)} ms`)
  const outs = await Promise.all(all.map((s) => s.commands.run('hostname')))
  assert.deepEqual(outs.map((r) => r.stdout.trim()), all.map((s) => s.sandboxId))
  assert.equal(new Set(all.map((s) => s.sandboxId)).size, 10)
  await Promise.all(all.map((s) => s.kill()))
})

test('refused as the SDK expects: a wrong key, a wrong token, another sandbox\'s token, a removed sandbox, an unknown template', async () => {
  const wrongKey = { ...opts, apiKey: 'e2b_' + '0'.repeat(40) }
  await rejectsWith(Sandbox.list(wrongKey).nextItems(), 'AuthenticationError', 'list with a wrong key')
  await rejectsWith(Sandbox.create(template, wrongKey), 'AuthenticationError', 'create with a wrong key')
  const other = await create({ timeoutMs: 300_000 })
  // The SDK's own constructor, as connect builds it, with a token that is
  // not the sandbox's.
  const as = (token) => new Sandbox({ ...opts, sandboxId: sbx.sandboxId, envdAccessToken: token, envdVersion: '0.6.4', sandboxDomain: other.sandboxDomain })
  for (const [what, token] of [['a wrong token', 'f'.repeat(64)], ['another sandbox\'s token', other.envdAccessToken]]) {
    const bad = as(token)
    await rejectsWith(bad.commands.run('true'), 'AuthenticationError', `commands.run with ${what}`)
    await rejectsWith(bad.files.read('/etc/hostname'), 'AuthenticationError', `files.read with ${what}`)
    await rejectsWith(bad.files.list('/'), 'AuthenticationError', `files.list with ${what}`)
  }
  const id = other.sandboxId
  assert.equal(await kill(other), true)
  assert.equal(await other.isRunning(), false)
  assert.equal(await kill(other), false)
  // A 502 on the stream: the SDK's "not running any more".
  await rejectsWith(other.commands.run('true'), sandboxNotFound, 'commands.run in a removed sandbox')
  await rejectsWith(other.files.read('/etc/hostname'), 'TimeoutError', 'files.read in a removed sandbox')
  await rejectsWith(Sandbox.connect(id, opts), sandboxNotFound, 'connect to a removed sandbox')
  await rejectsWith(Sandbox.getInfo(id, opts), sandboxNotFound, 'getInfo of a removed sandbox')
  await assert.rejects(Sandbox.create('no-such-template', opts), /404.*not found/)
})

test('a sandbox that expires', async () => {
  // The timeout counts from when the sandbox is ready.
  const s = await create({ timeoutMs: 30_000 })
  assert.equal((await s.commands.run('echo up')).stdout, 'up\n')
  await until('the sandbox gone at its timeout', async () => !(await s.isRunning()), 240, 500)
  await rejectsWith(Sandbox.getInfo(s.sandboxId, opts), sandboxNotFound, 'getInfo of an expired sandbox')
})

test('kill', async () => {
  assert.equal(await kill(sbx), true)
  assert.equal(await sbx.isRunning(), false)
})
