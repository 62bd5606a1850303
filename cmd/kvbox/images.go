package main

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
)

func (a *app) newCmdImages() *cobra.Command {
	c := &cobra.Command{
		Use:     "images",
		Aliases: []string{"image"},
		Short:   "Manage base images",
	}
	c.AddCommand(a.newCmdImagesLs(), a.newCmdImagesImport(), a.newCmdImagesRm())
	return c
}

func (a *app) newCmdImagesLs() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:     "ls",
		Short:   "List base images",
		Example: "  kvbox images ls",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error {
			ims, err := a.images().List()
			if err != nil {
				return err
			}
			if asJSON {
				if ims == nil {
					ims = []image.Image{}
				}
				e := json.NewEncoder(a.io.Out)
				e.SetIndent("", "  ")
				return e.Encode(ims)
			}
			w := tabwriter.NewWriter(a.io.Out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tDISK\tSIZE-ON-DISK\tBOOT\tAGENT\tCREATED")
			for _, im := range ims {
				boot := "disk"
				if im.Kernel != "" {
					boot = "kernel"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", im.Name, domain.FormatSize(im.VirtualSize),
					domain.FormatSize(im.SizeBytes), boot, im.Agent, im.Created.Local().Format("2006-01-02 15:04"))
			}
			return w.Flush()
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return c
}

func (a *app) newCmdImagesImport() *cobra.Command {
	var o image.ImportOptions
	c := &cobra.Command{
		Use:   "import NAME DISK",
		Short: "Register a base image: a bootable disk, or a disk with a kernel to boot directly",
		Example: `  kvbox images import mydistro ./disk.qcow2
  kvbox images import tiny disk.qcow2 --kernel vmlinuz --initrd initrd.img --cmdline 'console=ttyS0 root=/dev/vda'`,
		Args: exactArgs(2, "an image name and a disk file"),
		RunE: func(c *cobra.Command, args []string) error {
			if o.Agent != "" && o.Agent != "yes" && o.Agent != "no" && o.Agent != "unknown" {
				return fmt.Errorf("%w: --agent takes yes, no or unknown", errUsage)
			}
			o.Disk = args[1]
			im, err := a.images().Import(args[0], o)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ image %s registered (%s disk, %s on disk)\n", im.Name, domain.FormatSize(im.VirtualSize), domain.FormatSize(im.SizeBytes))
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&o.Kernel, "kernel", "", "kernel to boot directly")
	f.StringVar(&o.Initrd, "initrd", "", "initrd for --kernel")
	f.StringVar(&o.Cmdline, "cmdline", "console=ttyS0 root=/dev/vda rw", "kernel command line for --kernel")
	f.StringVar(&o.Agent, "agent", "unknown", "whether kvbox-agent is installed in the image: yes, no or unknown")
	f.BoolVar(&o.Replace, "replace", false, "replace an image of the same name")
	return c
}

func (a *app) newCmdImagesRm() *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME",
		Short:   "Delete a base image no box uses",
		Example: "  kvbox images rm old",
		Args:    exactArgs(1, "one image name"),
		RunE: func(c *cobra.Command, args []string) error {
			h, err := a.Host()
			if err != nil {
				return err
			}
			boxes, err := h.Boxes()
			if err != nil {
				return err
			}
			var users []string
			for _, b := range boxes {
				if b.Image == args[0] && b.Snapshot == "" {
					users = append(users, b.Name)
				}
			}
			if users != nil {
				return fmt.Errorf("%w: image %q is the base of boxes %v; remove them first", domain.ErrBusy, args[0], users)
			}
			if err := a.images().Remove(args[0]); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ image %s removed\n", args[0])
			return nil
		},
	}
}
