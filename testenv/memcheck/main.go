// Command memcheck runs in a guest for TestSnapshotKeepsEveryWrite: it
// writes a pattern over 64 MB again and again, each 4 KiB page whole with
// one value and that value kept apart in a table, until SIGUSR1; it then
// stops writing and prints how many pages differ from the table. In a
// clone of a snapshot taken while it ran, every page must still match: a
// page the snapshot copied before the guest's last write to it, and did
// not copy again, shows up here.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

const (
	pageWords = 512
	pages     = 64 << 20 / 4096
)

func main() {
	mem, err := syscall.Mmap(-1, 0, pages*4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		fmt.Println("mmap:", err)
		os.Exit(1)
	}
	words := unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), pages*pageWords)
	table := make([]uint64, pages)
	var stop, stopped atomic.Bool
	go func() {
		for gen := uint64(1); !stop.Load(); gen++ {
			for i := 0; i < pages && !stop.Load(); i++ {
				v := gen<<32 | uint64(i)
				for j := range words[i*pageWords : (i+1)*pageWords] {
					words[i*pageWords+j] = v
				}
				table[i] = v
			}
		}
		stopped.Store(true)
	}()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	fmt.Println("writing")
	<-sig
	stop.Store(true)
	for !stopped.Load() {
		time.Sleep(time.Millisecond)
	}
	bad := 0
	for i := 0; i < pages; i++ {
		for _, w := range words[i*pageWords : (i+1)*pageWords] {
			if w != table[i] {
				if bad < 5 {
					fmt.Printf("page %d holds %#x, the table %#x\n", i, w, table[i])
				}
				bad++
				break
			}
		}
	}
	fmt.Printf("checked %d pages: %d differ\n", pages, bad)
}
