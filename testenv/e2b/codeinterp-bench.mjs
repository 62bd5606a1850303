// The SDK's side of make bench's codeinterp section (testenv/bench/codeinterp.go),
// with @e2b/code-interpreter: one command a line on stdin, each answered
// with a JSON line, so that the bench alternates the templates it compares
// while this process stays up with its connections open.
//
//   first TEMPLATE    Sandbox.create(TEMPLATE), then runCode(FIRST_CELL):
//                     {"create_ms", "first_ms"} (first_ms from before the create)
//   trivial TEMPLATE N  one sandbox: N runCode('1') and N commands.run('true'),
//                     alternated, after one of each not counted:
//                     {"cell_ms": [...], "command_ms": [...]}
//
// Each sandbox is killed after it was timed. Environment: E2B_SDK_DIR,
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY.
import { createInterface } from 'node:readline'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const { Sandbox } = await import(pathToFileURL(require.resolve('@e2b/code-interpreter')).href)
const opts = { requestTimeoutMs: 600_000, timeoutMs: 600_000 }
const cell = { timeoutMs: 600_000, requestTimeoutMs: 600_000 }

// What an agent's first cell does with the data stack.
const FIRST_CELL = 'import pandas as pd\ndf = pd.DataFrame({"a": range(1000), "b": [i * 0.5 for i in range(1000)]})\ndf.describe()'

function check(ex) {
  if (ex.error) throw new Error(`the cell failed: ${ex.error.name}: ${ex.error.value}`)
  return ex
}

async function first(template) {
  const t0 = performance.now()
  const sbx = await Sandbox.create(template, opts)
  const t1 = performance.now()
  try {
    const ex = check(await sbx.runCode(FIRST_CELL, cell))
    const t2 = performance.now()
    if (!ex.text?.includes('count')) throw new Error(`describe() gave ${JSON.stringify(ex.results)}`)
    return { create_ms: t1 - t0, first_ms: t2 - t0 }
  } finally {
    await sbx.kill()
  }
}

async function trivial(template, n) {
  const sbx = await Sandbox.create(template, opts)
  try {
    check(await sbx.runCode('1', cell))
    await sbx.commands.run('true')
    const cells = [], commands = []
    for (let i = 0; i < n; i++) {
      let t0 = performance.now()
      const ex = check(await sbx.runCode('1', cell))
      cells.push(performance.now() - t0)
      if (ex.text !== '1') throw new Error(`runCode('1') gave ${ex.text}`)
      t0 = performance.now()
      await sbx.commands.run('true')
      commands.push(performance.now() - t0)
    }
    return { cell_ms: cells, command_ms: commands }
  } finally {
    await sbx.kill()
  }
}

for await (const line of createInterface({ input: process.stdin })) {
  const [cmd, template, arg] = line.trim().split(/\s+/)
  try {
    if (cmd === 'first') {
      console.log(JSON.stringify(await first(template)))
    } else if (cmd === 'trivial') {
      console.log(JSON.stringify(await trivial(template, Number(arg))))
    } else {
      console.log(JSON.stringify({ error: `unknown command ${cmd}` }))
    }
  } catch (err) {
    console.log(JSON.stringify({ error: String(err) }))
  }
}
