package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
)

func (a *app) newCmdImages() *cobra.Command {
	c := &cobra.Command{
		Use:     "images",
		Aliases: []string{"image"},
		Short:   "Manage base images",
	}
	c.AddCommand(a.newCmdImagesLs(), a.newCmdImagesImport(), a.newCmdImagesBuild(), a.newCmdImagesRm())
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
				return a.printJSON(ims)
			}
			w := a.table("NAME", "DISK", "SIZE-ON-DISK", "BOOT", "AGENT", "CREATED")
			for _, im := range ims {
				boot := "disk"
				if im.Kernel != "" {
					boot = "kernel"
				}
				w.row(im.Name, base.FormatSize(im.VirtualSize),
					base.FormatSize(im.SizeBytes), boot, im.Agent, im.Created.Local().Format("2006-01-02 15:04"))
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
				return usage("--agent takes yes, no or unknown")
			}
			o.Disk = args[1]
			im, err := a.images().Import(args[0], o)
			if err != nil {
				return err
			}
			// Older versions stay while boxes or snapshots build on them.
			if o.Replace {
				k, err := a.lib()
				if err != nil {
					return err
				}
				if err := k.PruneImage(c.Context(), im.Name); err != nil {
					return err
				}
			}
			fmt.Fprintf(a.io.Out, "✓ image %s registered (%s disk, %s on disk)\n", im.Name, base.FormatSize(im.VirtualSize), base.FormatSize(im.SizeBytes))
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&o.Kernel, "kernel", "", "kernel to boot directly")
	f.StringVar(&o.Initrd, "initrd", "", "initrd for --kernel")
	f.StringVar(&o.Cmdline, "cmdline", "console=ttyS0 root=/dev/vda rw", "kernel command line for --kernel")
	f.StringVar(&o.Agent, "agent", "", "whether kvbox-agent is installed in the image: yes, no or unknown (default: kvbox looks in the disk's ext filesystems)")
	f.BoolVar(&o.Replace, "replace", false, "make this the new version of an existing image (boxes and snapshots keep the version they were made from; it goes with the last of them)")
	return c
}

func (a *app) newCmdImagesRm() *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME",
		Short:   "Delete a base image no box or snapshot builds on",
		Example: "  kvbox images rm old",
		Args:    exactArgs(1, "one image name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			if err := k.RemoveImage(c.Context(), args[0]); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ image %s removed\n", args[0])
			return nil
		}),
	}
}
