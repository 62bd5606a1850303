package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/terminal"
)

func (a *app) newCmdImagesBuild() *cobra.Command {
	o := image.DebianOptions{}
	c := &cobra.Command{
		Use:   "build debian|code-interpreter",
		Short: "Build the default base image, or the code interpreter's, from Debian's packages (debootstrap; cached)",
		Long: `Build the default base image, "debian": Debian 12 (bookworm) from deb.debian.org
with debootstrap, the plain linux-image-amd64 kernel, systemd, apt, iproute2,
ca-certificates, curl, git and python3, and kvbox-agent as an early systemd
service that owns the network. The disk is an 8 GiB sparse qcow2 (ext4).

The image has a user "user" (uid 1000, /home/user, /bin/bash, passwordless
sudo), as E2B's sandboxes have.

"code-interpreter" is that image plus Debian's python3-ipykernel,
python3-jupyter-client, python3-zmq, python3-numpy, python3-pandas and
python3-matplotlib, installed with apt on the cached base tree, and kvbox's
code-interpreter server on the guest's 127.0.0.1:49999 (E2B's runCode and code
contexts; a Python kernel and kvbox's small bash kernel). Snapshot a box of it
once its server is ready to make the template code-interpreter-v1
(docs/e2b.md, "Code interpreter").

Building again does nothing while the image exists and was built from this
kvbox's recipe (its packages and the files it writes); an image built from
another recipe is built again, and --force rebuilds it anyway (downloaded
packages are kept in --cache-dir, so that is faster). Nothing is registered
unless the whole build succeeds.`,
		Example: `  kvbox images build debian
  kvbox images build debian --force --agent ./bin/kvbox-agent
  kvbox images build debian --ssh --name debian-ssh
  kvbox images build code-interpreter`,
		Args: exactArgs(1, "the image to build: debian or code-interpreter"),
		RunE: func(c *cobra.Command, args []string) error {
			switch args[0] {
			case "debian":
			case image.CodeInterpreterImage:
				o.CodeInterpreter = true
				if !c.Flags().Changed("name") {
					o.Name = image.CodeInterpreterImage
				}
			default:
				return usage("kvbox images build knows two images, debian and code-interpreter (got %q); bring others with kvbox images import", args[0])
			}
			// On standard output, as the build's lines always were.
			o.Progress = terminal.New(terminal.Options{Term: terminal.IfTerminal(a.raw.Out), Log: a.io.Out})
			im, built, err := image.BuildDebian(c.Context(), a.images(), o)
			if err != nil {
				return err
			}
			if built {
				// Older versions stay while boxes or snapshots build on them.
				k, err := a.lib()
				if err == nil {
					err = k.PruneImage(c.Context(), im.Name)
				}
				if err != nil {
					fmt.Fprintf(a.io.Err, "kvbox: warning: older versions of image %s not pruned: %v\n", im.Name, err)
				}
			} else {
				fmt.Fprintf(a.io.Out, "✓ image %s is already built (%s, %s disk, %s on disk); --force rebuilds it\n", im.Name,
					im.Created.Local().Format("2006-01-02 15:04"), base.FormatSize(im.VirtualSize), base.FormatSize(im.SizeBytes))
			}
			return nil
		},
	}
	f := c.Flags()
	f.BoolVar(&o.Force, "force", false, "rebuild even if the image exists")
	f.BoolVar(&o.SSH, "ssh", false, "include openssh-server (no host keys in the image: each box and each clone makes its own; reach it with kvbox ssh-proxy)")
	f.StringVar(&o.Name, "name", image.DefaultImage, "register the image under this name")
	f.StringVar(&o.Agent, "agent", "", "kvbox-agent binary to install (default: $KVBOX_AGENT, else next to kvbox)")
	f.StringVar(&o.Suite, "suite", "bookworm", "Debian suite")
	f.StringVar(&o.Mirror, "mirror", "http://deb.debian.org/debian", "Debian mirror")
	f.StringVar(&o.CacheDir, "cache-dir", "/var/cache/kvbox/debootstrap", "keep downloaded packages here for the next build ('-' for none)")
	return c
}
