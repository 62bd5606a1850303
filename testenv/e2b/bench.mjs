// The SDK's side of make bench's serve section (testenv/bench/serve.go): it
// reads one command a line on stdin and answers each with a JSON line, so
// that the bench alternates it with the CLI it is compared to while this
// process, as an agent's would, stays up with its connections open.
//
//   one      Sandbox.create(KVBOX_TEMPLATE), then commands.run('true'):
//            {"create_ms", "first_ms"} (first_ms from before the create)
//   many N   N of those at once: {"wall_ms", "create_ms": [...], "first_ms": [...]}
//
// Each sandbox is killed after it was timed. Environment: E2B_SDK_DIR,
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, KVBOX_TEMPLATE.
import { createInterface } from 'node:readline'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const { Sandbox } = await import(pathToFileURL(require.resolve('e2b')).href)
const opts = { requestTimeoutMs: 600_000, timeoutMs: 600_000 }

async function one() {
  const t0 = performance.now()
  const sbx = await Sandbox.create(process.env.KVBOX_TEMPLATE, opts)
  const t1 = performance.now()
  await sbx.commands.run('true')
  const t2 = performance.now()
  return { sbx, create_ms: t1 - t0, first_ms: t2 - t0 }
}

for await (const line of createInterface({ input: process.stdin })) {
  const [cmd, arg] = line.trim().split(/\s+/)
  try {
    if (cmd === 'one') {
      const r = await one()
      await r.sbx.kill()
      console.log(JSON.stringify({ create_ms: r.create_ms, first_ms: r.first_ms }))
    } else if (cmd === 'many') {
      const t0 = performance.now()
      const rs = await Promise.all(Array.from({ length: Number(arg) }, one))
      const wall = performance.now() - t0
      await Promise.all(rs.map((r) => r.sbx.kill()))
      console.log(JSON.stringify({ wall_ms: wall, create_ms: rs.map((r) => r.create_ms), first_ms: rs.map((r) => r.first_ms) }))
    } else {
      console.log(JSON.stringify({ error: `unknown command ${cmd}` }))
    }
  } catch (err) {
    console.log(JSON.stringify({ error: String(err) }))
  }
}
