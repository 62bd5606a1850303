// E2B's code interpreter SDK (@e2b/code-interpreter, unmodified, from npm)
// against `kvbox serve`, run by TestCodeInterpreter (testenv) in the
// kvbox-test namespace, on warm clones of the template code-interpreter-v1
// (the SDK's default): a box of the code-interpreter image snapshotted with
// its Python kernel running and the data stack imported.
//
// Environment: E2B_SDK_DIR (testenv/e2b/code-interpreter-V), E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY (kvbox serve's), KVBOX_SERVE_ADDR.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const ci = await import(pathToFileURL(require.resolve('@e2b/code-interpreter')).href)
const { Sandbox, NotFoundError, TimeoutError } = ci
const [serveHost, servePort] = process.env.KVBOX_SERVE_ADDR.split(':')
// Clones under emulation on a shared 2-core machine take seconds each.
const opts = { requestTimeoutMs: 600_000 }
const made = []
after(async () => {
  await Promise.all(made.map((s) => s.kill().catch(() => {})))
})

async function create(o = {}) {
  // No template: the SDK's default, code-interpreter-v1.
  const s = await Sandbox.create({ timeoutMs: 1_800_000, ...opts, ...o })
  made.push(s)
  return s
}

const stdout = (ex) => ex.logs.stdout.join('')
// A cell's bound: generous, for emulation.
const run = (sbx, code, o = {}) => sbx.runCode(code, { timeoutMs: 600_000, ...opts, ...o })

let sbx
test('create from the default template', async () => {
  assert.equal(Sandbox.defaultTemplate, 'code-interpreter-v1')
  sbx = await create()
})

test('state between cells', async () => {
  const ex = await run(sbx, 'x = 41\nx + 1')
  assert.equal(ex.error, undefined)
  assert.equal(ex.results[0].text, '42')
  assert.equal(ex.text, '42')
  const ex2 = await run(sbx, 'x')
  assert.equal(ex2.text, '41')
  assert.ok(ex2.executionCount > ex.executionCount)
})

test('the template imported the data stack before its snapshot', async () => {
  const ex = await run(sbx, 'import sys\nprint(sorted(m for m in ("numpy", "pandas", "matplotlib") if m in sys.modules))\nimport matplotlib\nmatplotlib.get_backend()')
  assert.equal(stdout(ex), "['matplotlib', 'numpy', 'pandas']\n")
  assert.match(ex.text, /inline/)
  const df = await run(sbx, 'import pandas as pd\npd.DataFrame({"a": [1, 2, 3]})')
  assert.ok(df.results[0].html.includes('<table'), JSON.stringify(df.results[0]))
})

test('cells run as the image\'s user, not root', async () => {
  const ex = await run(sbx, 'import os, pwd\nprint(os.getuid(), pwd.getpwuid(os.getuid()).pw_name, os.getcwd())')
  assert.equal(stdout(ex), '1000 user /home/user\n')
})

test('a matplotlib figure is a PNG result', async () => {
  const ex = await run(sbx, 'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()')
  assert.equal(ex.error, undefined)
  const png = ex.results.find((r) => r.png)
  assert.ok(png, JSON.stringify(ex.results.map((r) => r.formats())))
  assert.equal(Buffer.from(png.png, 'base64').subarray(1, 4).toString(), 'PNG')
})

test('an error with its traceback', async () => {
  const ex = await run(sbx, 'def f():\n    return 1/0\nf()')
  assert.equal(ex.error.name, 'ZeroDivisionError')
  assert.equal(ex.error.value, 'division by zero')
  const tb = ex.error.traceback.replace(/\x1b\[[0-9;]*m/g, '') // IPython colours it
  assert.match(tb, /ZeroDivisionError/)
  assert.match(tb, /return 1\/0/)
})

test('stdout and stderr stream while the cell runs', async () => {
  // The cell waits for a file the test writes only once it has the cell's
  // first line: it ends only if that line arrived while it ran.
  const seen = []
  const ex = await run(sbx, [
    'import os, sys, time',
    'print("first", flush=True)',
    'print("to stderr", file=sys.stderr, flush=True)',
    'while not os.path.exists("/tmp/go"):',
    '    time.sleep(0.1)',
    'print("second")',
  ].join('\n'), {
    onStdout: async (m) => {
      seen.push(['out', m.line])
      if (m.line.includes('first')) await sbx.files.write('/tmp/go', 'go')
    },
    onStderr: (m) => seen.push(['err', m.line]),
  })
  assert.equal(ex.error, undefined)
  assert.deepEqual(seen, [['out', 'first\n'], ['err', 'to stderr\n'], ['out', 'second\n']])
})

test('contexts: create, list, isolation, cwd, restart, remove', async () => {
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.language, 'python')
  assert.equal(ctx.cwd, '/tmp')
  const list = await sbx.listCodeContexts()
  assert.ok(list.some((c) => c.id === ctx.id), JSON.stringify(list))
  assert.ok(list.some((c) => c.id !== ctx.id && c.language === 'python'), 'the default python context')
  const cwd = await run(sbx, 'import os\nprint(os.getcwd())', { context: ctx })
  assert.equal(stdout(cwd), '/tmp\n')
  const iso = await run(sbx, 'x', { context: ctx })
  assert.equal(iso.error?.name, 'NameError')
  await run(sbx, 'y = 7', { context: ctx })
  assert.equal((await run(sbx, 'y', { context: ctx })).text, '7')
  await sbx.restartCodeContext(ctx)
  assert.equal((await run(sbx, 'y', { context: ctx })).error?.name, 'NameError')
  assert.equal((await run(sbx, 'x')).text, '41', 'the default context kept its state')
  await sbx.removeCodeContext(ctx.id)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  await assert.rejects(run(sbx, '1', { context: ctx }), NotFoundError)
})

test('bash: a language of its own, state kept', async () => {
  const a = await run(sbx, 'cd /tmp && N=5\necho "hi $N"', { language: 'bash' })
  assert.equal(a.error, undefined)
  assert.equal(stdout(a), 'hi 5\n')
  const b = await run(sbx, 'echo "$N $(pwd)"; echo oops >&2', { language: 'bash' })
  assert.equal(stdout(b), '5 /tmp\n')
  assert.equal(b.logs.stderr.join(''), 'oops\n')
  const c = await run(sbx, 'false', { language: 'bash' })
  assert.equal(c.error?.value, 'exit status 1')
  const list = await sbx.listCodeContexts()
  assert.ok(list.some((c) => c.language === 'bash'), JSON.stringify(list))
  // A timeout interrupts the command the shell runs; the shell lives on.
  await assert.rejects(run(sbx, 'sleep 300; touch /tmp/bash-late', { language: 'bash', timeoutMs: 5_000 }), TimeoutError)
  assert.equal(stdout(await run(sbx, 'test -e /tmp/bash-late && echo late || echo "not late $N"', { language: 'bash' })), 'not late 5\n')
  const bashCtx = await sbx.createCodeContext({ language: 'bash' })
  assert.equal(stdout(await run(sbx, 'echo "[$N]"', { context: bashCtx })), '[]\n')
})

test('an unknown language is refused, naming the kernels present', async () => {
  await assert.rejects(run(sbx, '1', { language: 'cobol' }), (e) => {
    assert.ok(e instanceof NotFoundError, String(e))
    assert.match(e.message, /cobol/)
    assert.match(e.message, /python3/)
    assert.match(e.message, /bash/)
    return true
  })
})

test('env vars: per call, then gone; bash too', async () => {
  const code = 'import os\nprint(os.environ.get("KV_CALL"), os.environ.get("HOME"))'
  const a = await run(sbx, code, { envs: { KV_CALL: 'per-call' } })
  assert.equal(stdout(a), 'per-call /home/user\n')
  const b = await run(sbx, code)
  assert.equal(stdout(b), 'None /home/user\n')
  const c = await run(sbx, 'echo "[$KV_CALL]"', { language: 'bash', envs: { KV_CALL: "it's" } })
  assert.equal(stdout(c), "[it's]\n")
  assert.equal(stdout(await run(sbx, 'echo "[$KV_CALL]"', { language: 'bash' })), '[]\n')
})

test('a timeout interrupts the kernel and leaves the context usable', async () => {
  await assert.rejects(
    run(sbx, 'import time\ntime.sleep(300)\nopen("/tmp/after-timeout", "w").write("late")', { timeoutMs: 5_000 }),
    TimeoutError)
  // The next cell runs only once the interrupted one is over: had the
  // kernel not been interrupted, it would wait for the sleep and find
  // the file.
  const ex = await run(sbx, 'import os\nos.path.exists("/tmp/after-timeout")')
  assert.equal(ex.text, 'False')
  assert.equal((await run(sbx, 'x')).text, '41')
})

test('a client that disconnects mid-cell interrupts the kernel', async () => {
  // A raw request, as the SDK makes it, dropped once the cell has started.
  const body = JSON.stringify({ code: 'import time\nprint("started", flush=True)\ntime.sleep(300)\nopen("/tmp/after-disconnect", "w").write("late")' })
  await new Promise((resolve, reject) => {
    const req = http.request({
      host: serveHost, port: servePort, method: 'POST', path: '/execute',
      headers: {
        'Content-Type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49999',
        'X-Access-Token': sbx.envdAccessToken ?? '', 'Content-Length': Buffer.byteLength(body),
      },
    }, (res) => {
      assert.equal(res.statusCode, 200)
      let buf = ''
      res.on('data', (d) => {
        buf += d
        if (buf.includes('"started')) { req.destroy(); resolve() }
      })
      res.on('end', () => reject(new Error('the cell ended: ' + buf)))
    })
    req.on('error', (e) => { if (!req.destroyed) reject(e) })
    req.end(body)
  })
  const ex = await run(sbx, 'import os\nos.path.exists("/tmp/after-disconnect")')
  assert.equal(ex.text, 'False')
  assert.equal((await run(sbx, 'x')).text, '41')
})

test('a kernel that dies: the next call says so, a restart brings it back', async () => {
  const ctx = await sbx.createCodeContext()
  await run(sbx, 'z = 1', { context: ctx })
  const died = await run(sbx, 'import os\nos._exit(3)', { context: ctx })
  assert.equal(died.error?.name, 'DeadKernelError', JSON.stringify(died))
  const next = await run(sbx, 'z', { context: ctx })
  assert.equal(next.error?.name, 'DeadKernelError')
  assert.match(next.error.value, /restart/)
  await sbx.restartCodeContext(ctx)
  const after = await run(sbx, 'z = 2\nz * 21', { context: ctx })
  assert.equal(after.text, '42')
  assert.equal((await run(sbx, 'x')).text, '41', 'the default context is untouched')
})

test('sandbox-wide envs (envd) reach the kernel', async () => {
  const s = await create({ envs: { KV_SANDBOX: 'wide' } })
  const ex = await run(s, 'import os\nprint(os.environ.get("KV_SANDBOX"))')
  assert.equal(stdout(ex), 'wide\n')
  const b = await run(s, 'import os\nprint(os.environ.get("KV_SANDBOX"))', { envs: { KV_SANDBOX: 'call' } })
  assert.equal(stdout(b), 'call\n')
  assert.equal(stdout(await run(s, 'import os\nprint(os.environ.get("KV_SANDBOX"))')), 'wide\n')
  await s.kill()
})

test('five sandboxes running cells at once', async () => {
  const n = Number(process.env.KVBOX_CI_PARALLEL || 5)
  const boxes = await Promise.all(Array.from({ length: n }, () => create()))
  const outs = await Promise.all(boxes.map((s, i) =>
    run(s, `import pandas as pd, numpy as np\nv = ${i}\npd.DataFrame({"a": np.arange(4) + v})["a"].sum()`)))
  outs.forEach((ex, i) => assert.equal(ex.text, String(6 + 4 * i), JSON.stringify(ex)))
  // Each its own kernel.
  const again = await Promise.all(boxes.map((s) => run(s, 'v')))
  again.forEach((ex, i) => assert.equal(ex.text, String(i)))
  await Promise.all(boxes.map((s) => s.kill()))
})
