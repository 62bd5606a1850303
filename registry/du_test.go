package registry

import "syscall"

type syscallStat = syscall.Stat_t

func statBlocks(path string, st *syscall.Stat_t) (int64, error) {
	if err := syscall.Stat(path, st); err != nil {
		return 0, err
	}
	return st.Blocks * 512, nil
}
