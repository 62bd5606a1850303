// The real E2B JS SDK's network options against kvbox serve, run by
// TestServeEgress (testenv/servegress_e2e_test.go) on a fake internet of the
// test's own: allowed.test, other.test and their addresses, a test CA in
// the template's /root/egress-ca.pem.
//
// Environment: as serve.test.mjs, plus KVBOX_ALLOWED_IP and KVBOX_OTHER_IP;
// KVBOX_SECRET, the value of the secret a rule's header names (the fake
// server's /auth says whether it got it), and KVBOX_OUT, a file the test
// writes the sandbox and snapshot it leaves for the Go side's checks to.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const require = createRequire(process.env.E2B_SDK_DIR + '/package.json')
const e2b = await import(pathToFileURL(require.resolve('e2b')).href)
const { Sandbox, Secret } = e2b
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

test('rules: a header from a Secret, the value never in the sandbox, and updateNetwork replacing the rules', async () => {
  const key = process.env.KVBOX_SECRET
  const info = await Secret.create('egkey', key, { ...opts, metadata: { for: 'kvbox' } })
  after(() => Secret.destroy('egkey', opts).catch(() => {}))
  assert.equal(info.name, 'egkey')
  assert.ok(!JSON.stringify(info).includes(key), 'Secret.create answered the value')
  assert.ok(await Secret.exists('egkey', opts), 'Secret.exists')
  const allowOut = ['allowed.test', '*.wild.test']
  const s = await Sandbox.create(template, {
    timeoutMs: 900_000, ...opts,
    network: { allowOut, denyOut: ['0.0.0.0/0'], rules: { 'allowed.test': [{ transform: { headers: { Authorization: `Bearer ${Secret.fill('egkey')}` } } }] } },
  })
  // Left running for the Go side, which removes it.
  const sh = async (cmd) => (await s.commands.run(cmd, { user: 'root', timeoutMs: 120_000 })).stdout.trim()
  // The sandbox trusts the host's egress CA in its own trust store: no --cacert.
  assert.equal(await sh('curl -s -m 20 https://allowed.test/auth || echo FAIL'), 'allowed host=allowed.test auth=ok', 'the header from the secret')
  assert.equal(await sh("curl -s -m 20 -H 'Authorization: Bearer mine' https://allowed.test/auth || echo FAIL"), 'allowed host=allowed.test auth=ok', 'over the sandbox\'s own header')
  assert.equal(await fetch(s, 'https://api.wild.test/auth'), 'wild host=api.wild.test auth=none', 'a name without a rule passes untouched')
  // The value is nowhere the sandbox can read: no process's environment,
  // no file (it is split here so that the command holds no copy of it).
  const half = Math.floor(key.length / 2)
  const find = `A='${key.slice(0, half)}'; B='${key.slice(half)}'; `
  assert.equal(await sh(find + 'cat /proc/[0-9]*/environ 2>/dev/null | tr "\\0" "\\n" | grep -c -F -- "$A$B"; true'), '0', 'the secret in an environment')
  assert.equal(await sh(find + 'grep -r -l -s -D skip -F -- "$A$B" /etc /root /home /tmp /var /opt /usr/local /run /srv 2>/dev/null | head -3; true'), '', 'the secret in a file')

  // The E2B SDK's own form: a value resolved on the client, in the rule.
  await s.updateNetwork({ allowOut, denyOut: ['0.0.0.0/0'], rules: { 'allowed.test': [{ transform: { headers: { Authorization: 'Bearer ' + key } } }] } }, opts)
  assert.equal(await sh('curl -s -m 20 https://allowed.test/auth || echo FAIL'), 'allowed host=allowed.test auth=ok', 'a literal header value')
  const xml = execFileSync('virsh', ['-c', 'qemu:///system', 'dumpxml', s.sandboxId]).toString()
  assert.ok(xml.includes('<header'), 'the definition holds the rule')
  assert.ok(!xml.includes(key) && !xml.includes('Bearer'), 'a header value in the definition')
  // Its memory and disk, for the Go side to search.
  const snap = await s.createSnapshot(opts)

  // Rules replaced: another header; then none.
  await s.updateNetwork({ allowOut, denyOut: ['0.0.0.0/0'], rules: { 'api.wild.test': [{ transform: { headers: { Authorization: 'Bearer other' } } }] } }, opts)
  assert.equal(await fetch(s, 'https://allowed.test/auth'), 'allowed host=allowed.test auth=none', 'allowed.test after its rule went')
  assert.equal(await sh('curl -s -m 20 https://api.wild.test/auth || echo FAIL'), 'wild host=api.wild.test auth=other', 'the new rule')
  await s.updateNetwork({ allowOut, denyOut: ['0.0.0.0/0'] }, opts)
  assert.equal(await fetch(s, 'https://api.wild.test/auth'), 'wild host=api.wild.test auth=none', 'no rule after an update without rules')
  writeFileSync(process.env.KVBOX_OUT, JSON.stringify({ sandbox: s.sandboxId, snapshot: snap.snapshotId }))
})

test('a rule naming a secret that is not there, or an IAM token, is refused', async () => {
  await assert.rejects(create({ network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'], rules: { 'allowed.test': [{ transform: { headers: { A: Secret.fill('nosuch') } } }] } } }), /400|not found/i)
  await assert.rejects(create({ network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'], rules: { 'allowed.test': [{ transform: { headers: { A: '${secret:egkey}' } } }] } } }), /400|names a secret/i)
})
