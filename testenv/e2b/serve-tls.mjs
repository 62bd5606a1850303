// The real E2B JS SDK against `kvbox serve --tls`, with nothing but the
// SDK's own defaults for the sandbox's traffic: no E2B_SANDBOX_URL, so
// envd is reached at https://49983-ID.DOMAIN (the domain serve answers),
// and a port at https://getHost(PORT), each name resolved by the system's
// resolver (the test's, a wildcard for the domain) and each certificate
// verified against serve's CA (NODE_EXTRA_CA_CERTS). Run by TestServe.
//
// Environment: E2B_SDK_DIR, E2B_API_URL (https://ADDR), E2B_API_KEY,
// KVBOX_TEMPLATE, KVBOX_TEMPLATE_PAGE, KVBOX_SERVE_ADDR.
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const { Sandbox } = await import(pathToFileURL(require.resolve('e2b')).href)
assert.equal(process.env.E2B_SANDBOX_URL, undefined)
assert.match(process.env.E2B_API_URL, /^https:\/\//)
const port = process.env.KVBOX_SERVE_ADDR.split(':')[1]
const opts = { requestTimeoutMs: 600_000 }

const sbx = await Sandbox.create(process.env.KVBOX_TEMPLATE, { ...opts, timeoutMs: 300_000 })
try {
  assert.equal(sbx.sandboxDomain, `kvbox.localhost:${port}`)
  const r = await sbx.commands.run('echo over-tls; hostname')
  assert.equal(r.stdout, `over-tls\n${sbx.sandboxId}\n`)
  await sbx.files.write('/home/user/tls.txt', 'written over TLS')
  assert.equal(await sbx.files.read('/home/user/tls.txt'), 'written over TLS')
  assert.equal(await sbx.isRunning(), true)
  // getHost as E2B code uses it: https://PORT-ID.DOMAIN, nothing else.
  const host = sbx.getHost(8000)
  assert.equal(host, `8000-${sbx.sandboxId}.kvbox.localhost:${port}`)
  const res = await fetch(`https://${host}/`)
  assert.equal(res.status, 200)
  assert.equal(await res.text(), process.env.KVBOX_TEMPLATE_PAGE)
  console.log(`# e2b: envd and port 8000 of ${sbx.sandboxId} over https, names from the resolver`)
} finally {
  await Sandbox.kill(sbx.sandboxId, opts)
}
assert.equal(await Sandbox.kill(sbx.sandboxId, opts), false)
