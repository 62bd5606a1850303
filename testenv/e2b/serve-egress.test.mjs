// The real E2B JS SDK's network options against kvbox serve, run by
// TestServeEgress (testenv/servegress_e2e_test.go) on a fake internet of the
// test's own: allowed.test, other.test and their addresses, a test CA in
// the template's /root/egress-ca.pem.
//
// Environment: as serve.test.mjs, plus KVBOX_ALLOWED_IP and KVBOX_OTHER_IP.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox } = e2b
const template = process.env.KVBOX_TEMPLATE
const opts = { requestTimeoutMs: 600_000 }
const made = []
after(async () => {
  await Promise.all(made.map((s) => s.kill().catch(() => {})))
})
async function create(o) {
  const s = await Sandbox.create(template, { timeoutMs: 900_000, ...opts, ...o })
  made.push(s)
  return s
}

// fetch is what the sandbox's curl got: the body, or FAIL.
async function fetch(s, url) {
  const r = await s.commands.run(`curl -s -m 20 --cacert /root/egress-ca.pem ${url} || echo FAIL`, { user: 'root', timeoutMs: 120_000 })
  return r.stdout.trim()
}
const reaches = (body, name) => body.startsWith(`${name} host=`)

test('allowOut by name with denyOut 0.0.0.0/0, then updateNetwork while it runs', async () => {
  const s = await create({ network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'] } })
  assert.ok(reaches(await fetch(s, 'https://allowed.test/'), 'allowed'), 'https://allowed.test/ with it allowed')
  assert.ok(reaches(await fetch(s, 'http://allowed.test/'), 'allowed'), 'http://allowed.test/ with it allowed')
  assert.ok(!reaches(await fetch(s, 'https://other.test/'), 'other'), 'https://other.test/ got through a deny-all')
  assert.ok(!reaches(await fetch(s, `http://${process.env.KVBOX_ALLOWED_IP}/`), 'allowed'), 'the allowed name\'s address reached when only the name is allowed')
  const pid = (await s.commands.run('setsid sleep 100000 >/dev/null 2>&1 </dev/null & echo $!')).stdout.trim()

  await s.updateNetwork({ allowOut: ['other.test'], denyOut: ['0.0.0.0/0'] }, opts)
  assert.ok(reaches(await fetch(s, 'https://other.test/'), 'other'), 'other.test after the update allowed it')
  assert.ok(!reaches(await fetch(s, 'https://allowed.test/'), 'allowed'), 'allowed.test after the update replaced the policy')
  assert.equal((await s.commands.run(`kill -0 ${pid} && echo alive`)).stdout.trim(), 'alive', 'a process of the sandbox outlived the update')

  await s.updateNetwork({}, opts)
  // No rule: the box is as any other, its DNS its own again (the name is
  // given its address here).
  assert.ok(reaches(await fetch(s, `--resolve allowed.test:443:${process.env.KVBOX_ALLOWED_IP} https://allowed.test/`), 'allowed'), 'no rule: everything allowed again')
})

test('allowInternetAccess false with an address allowed', async () => {
  const s = await create({ allowInternetAccess: false, network: { allowOut: [process.env.KVBOX_ALLOWED_IP] } })
  assert.ok(reaches(await fetch(s, `http://${process.env.KVBOX_ALLOWED_IP}/`), 'allowed'), 'the allowed address')
  assert.ok(!reaches(await fetch(s, `http://${process.env.KVBOX_OTHER_IP}/`), 'other'), 'another address with allowInternetAccess false')
})

test('what kvbox cannot enforce is refused', async () => {
  await assert.rejects(create({ network: { denyOut: ['evil.test'] } }), /400|names/i)
})
