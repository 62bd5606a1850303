package envd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"kvbox.dev/kvbox/guest-agent/envd/spec/filesystem"
	"kvbox.dev/kvbox/guest-agent/guestexec"
)

type filesystemService struct{ s *Server }

// callPath resolves a call's path for the user its header names.
func (s *Server) callPath(h http.Header, p string) (string, *guestexec.User, error) {
	u, err := s.userFromHeader(h)
	if err != nil {
		return "", nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	abs, err := resolvePath(p, u)
	if err != nil {
		return "", nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	return abs, u, nil
}

// fsError turns a filesystem error into the Connect code the SDKs map.
func fsError(err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, fs.ErrExist):
		return connect.NewError(connect.CodeAlreadyExists, err)
	case errors.Is(err, fs.ErrPermission):
		return connect.NewError(connect.CodePermissionDenied, err)
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.EINVAL):
		return connect.NewError(connect.CodeInvalidArgument, err)
	case errors.Is(err, syscall.ENOSPC):
		return connect.NewError(connect.CodeResourceExhausted, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

func (fsv *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	p, _, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	e, err := entryInfo(p)
	if err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: e}), nil
}

func (fsv *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	p, u, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", p))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s exists and is not a directory", p))
	}
	if err := mkdirAllAs(p, u); err != nil {
		return nil, fsError(err)
	}
	e, err := entryInfo(p)
	if err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: e}), nil
}

func (fsv *filesystemService) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	src, u, err := fsv.s.callPath(req.Header(), req.Msg.Source)
	if err != nil {
		return nil, err
	}
	dst, _, err := fsv.s.callPath(req.Header(), req.Msg.Destination)
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(src); err != nil {
		return nil, fsError(err)
	}
	if err := mkdirAllAs(filepath.Dir(dst), u); err != nil {
		return nil, fsError(err)
	}
	if err := os.Rename(src, dst); err != nil {
		return nil, fsError(err)
	}
	e, err := entryInfo(dst)
	if err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: e}), nil
}

func (fsv *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	p, _, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.Depth)
	if depth < 1 {
		depth = 1
	}
	st, err := os.Stat(p)
	if err != nil {
		return nil, fsError(err)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", p))
	}
	var entries []*filesystem.EntryInfo
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		des, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, de := range des {
			child := filepath.Join(dir, de.Name())
			e, err := entryInfo(child)
			if err != nil {
				continue // gone meanwhile
			}
			entries = append(entries, e)
			// Symlinks are listed, never followed.
			if level < depth && de.IsDir() {
				if err := walk(child, level+1); err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, fs.ErrPermission) {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(p, 1); err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.ListDirResponse{Entries: entries}), nil
}

func (fsv *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	p, _, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	// A path that is not there is removed already: envd's Remove is a
	// no-op then, and code written for E2B removes without looking first.
	if err := os.RemoveAll(p); err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

// entryInfo describes path without following it when it is a symlink,
// with its metadata (file metadata, metadata.go).
func entryInfo(path string) (*filesystem.EntryInfo, error) {
	st, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	e := &filesystem.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         st.Size(),
		Mode:         uint32(st.Mode().Perm()),
		Permissions:  st.Mode().String(),
		ModifiedTime: timestamppb.New(st.ModTime()),
		Metadata:     readMetadata(path),
	}
	switch {
	case st.Mode()&fs.ModeSymlink != 0:
		e.Type = filesystem.FileType_FILE_TYPE_SYMLINK
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			target, _ = os.Readlink(path) // dangling: where it points
		}
		e.SymlinkTarget = &target
	case st.IsDir():
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
	default:
		e.Type = filesystem.FileType_FILE_TYPE_FILE
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		e.Owner = userName(sys.Uid)
		e.Group = groupName(sys.Gid)
	}
	return e, nil
}

// names caches the user and group names found ("u1000", "g1000"); an id
// without one is looked up again next time (a user added since).
var names sync.Map

func userName(uid uint32) string {
	k := "u" + strconv.Itoa(int(uid))
	if v, ok := names.Load(k); ok {
		return v.(string)
	}
	n := strconv.Itoa(int(uid))
	if u, err := user.LookupId(n); err == nil {
		names.Store(k, u.Username)
		return u.Username
	}
	return n
}

func groupName(gid uint32) string {
	k := "g" + strconv.Itoa(int(gid))
	if v, ok := names.Load(k); ok {
		return v.(string)
	}
	n := strconv.Itoa(int(gid))
	if g, err := user.LookupGroupId(n); err == nil {
		names.Store(k, g.Name)
		return g.Name
	}
	return n
}
