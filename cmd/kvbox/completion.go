package main

import (
	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/snapshot"
)

// addCompletions teaches the shell completion (kvbox completion bash) the
// names of boxes, snapshots and images.
func (a *app) addCompletions(root *cobra.Command) {
	find := func(path ...string) *cobra.Command {
		c, _, err := root.Find(path)
		if err != nil {
			panic(err)
		}
		return c
	}
	for _, p := range [][]string{{"exec"}, {"connect"}, {"start"}, {"ip"}, {"snapshots", "new"}, {"port-forward"}, {"ssh-proxy"}, {"ttl"}} {
		find(p...).ValidArgsFunction = firstArg(a.completeBoxes)
	}
	for _, p := range [][]string{{"stop"}, {"rm"}, {"ssh-config"}, {"suspend"}, {"resume"}} {
		find(p...).ValidArgsFunction = a.completeBoxes
	}
	find("snapshots", "rm").ValidArgsFunction = a.completeSnapshots
	find("images", "rm").ValidArgsFunction = firstArg(a.completeImages)
	newCmd := find("new")
	newCmd.RegisterFlagCompletionFunc("from", a.completeSnapshots)
	newCmd.RegisterFlagCompletionFunc("image", a.completeImages)
}

// completeBoxes completes box names for the shell.
func (a *app) completeBoxes(c *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	return completeNames(a.boxes, func(b kvbox.Box) string { return b.Name })
}

// completeSnapshots completes snapshot names for the shell.
func (a *app) completeSnapshots(c *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	return completeNames(a.snapshots().List, func(s snapshot.Snapshot) string { return s.Name })
}

// completeImages completes image names for the shell.
func (a *app) completeImages(c *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	return completeNames(a.images().List, func(im image.Image) string { return im.Name })
}

// completeNames is the names of what list lists (none when it fails).
func completeNames[T any](list func() ([]T, error), name func(T) string) ([]string, cobra.ShellCompDirective) {
	var names []string
	items, _ := list()
	for _, it := range items {
		names = append(names, name(it))
	}
	return names, cobra.ShellCompDirectiveNoFileComp
}

// firstArg limits a completion to the first argument.
func firstArg(f cobra.CompletionFunc) cobra.CompletionFunc {
	return func(c *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return f(c, args, toComplete)
	}
}
