package image

import (
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
)

// CodeInterpreterImage is the image `kvbox images build code-interpreter`
// makes: the Debian image plus Jupyter's Python kernel, the data stack and
// kvbox's code-interpreter server on the guest's 127.0.0.1:49999, which is
// what E2B's code-interpreter SDKs (runCode, contexts) talk to.
const CodeInterpreterImage = "code-interpreter"

// CodeInterpreterPackages are added to the Debian image by the
// code-interpreter recipe, all from Debian's own archive: the kernel
// (ipykernel), the library that starts and talks to it (jupyter_client on
// pyzmq) and the data stack its template imports before the snapshot.
var CodeInterpreterPackages = []string{
	"python3-ipykernel", "python3-jupyter-client", "python3-zmq",
	"python3-numpy", "python3-pandas", "python3-matplotlib",
}

// codeInterpServer is kvbox's own code-interpreter server
// (image/codeinterp/kvbox-codeinterp.py): E2B's :49999 HTTP contract over
// one Jupyter kernel per context, started with jupyter_client.
//
//go:embed codeinterp/kvbox-codeinterp.py
var codeInterpServer string

// codeInterpBashKernel is kvbox's small bash kernel for language "bash"
// (Debian packages none).
//
//go:embed codeinterp/kvbox_bash_kernel.py
var codeInterpBashKernel string

// codeInterpBashSpec registers codeInterpBashKernel as the kernel "bash".
const codeInterpBashSpec = `{
 "argv": ["/usr/bin/python3", "/usr/local/lib/kvbox/kvbox_bash_kernel.py", "-f", "{connection_file}"],
 "display_name": "Bash (kvbox)",
 "language": "bash",
 "interrupt_mode": "signal"
}
`

const (
	codeInterpServerPath = "usr/local/lib/kvbox/kvbox-codeinterp.py"
	codeInterpBashPath   = "usr/local/lib/kvbox/kvbox_bash_kernel.py"
	codeInterpBashSpecAt = "usr/local/share/jupyter/kernels/bash/kernel.json"
)

// codeInterpUnit starts the server once the agent is up (the agent owns
// the network and envd's loopback door, where the server reads the
// sandbox's env vars). It runs as root to read the box's local envd token;
// the kernels it starts run as DebianUser in /home/user.
const codeInterpUnit = `# Installed by kvbox images build code-interpreter.
[Unit]
Description=kvbox code interpreter (E2B's runCode on 127.0.0.1:49999)
After=kvbox-agent.service
Wants=kvbox-agent.service

[Service]
ExecStart=/usr/bin/python3 /` + codeInterpServerPath + `
Restart=always
RestartSec=1s
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
`

// configureCodeInterp installs the server, its unit and the bash kernel,
// and checks that what the server needs was installed.
func configureCodeInterp(root string) error {
	for _, m := range []string{"jupyter_client", "ipykernel", "zmq", "numpy", "pandas", "matplotlib"} {
		if g, _ := filepath.Glob(filepath.Join(root, "usr/lib/python3/dist-packages", m)); len(g) == 0 {
			return fmt.Errorf("python module %s did not install", m)
		}
	}
	if err := writeFiles(root, map[string]string{
		codeInterpServerPath:                          codeInterpServer,
		codeInterpBashPath:                            codeInterpBashKernel,
		codeInterpBashSpecAt:                          codeInterpBashSpec,
		"etc/systemd/system/kvbox-codeinterp.service": codeInterpUnit,
	}); err != nil {
		return err
	}
	link := filepath.Join(root, "etc/systemd/system/multi-user.target.wants/kvbox-codeinterp.service")
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		return err
	}
	os.Remove(link)
	return os.Symlink("/etc/systemd/system/kvbox-codeinterp.service", link)
}

// codeInterpRecipe is what the code-interpreter recipe adds to
// DebianRecipe's digest.
func codeInterpRecipe() []string {
	return []string{codeInterpServer, codeInterpBashKernel, codeInterpBashSpec, codeInterpUnit}
}
