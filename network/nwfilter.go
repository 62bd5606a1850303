package network

import (
	_ "embed"
	"encoding/xml"
	"errors"
	"fmt"

	"libvirt.org/go/libvirt"
)

// filterXML is kvbox's libvirt network filter: a box's frames carry its
// own MAC, its IPv4 packets and ARP its own address, nothing else (no
// IPv6, no other ethertype) gets in or out.
//
//go:embed filter.xml
var filterXML string

// FilterName is the libvirt nwfilter every box's interface references,
// with the box's address as its IP parameter. The name carries a version:
// kvbox never redefines a filter a running box may use, a new rule set gets
// a new name.
var FilterName = func() string {
	var f struct {
		Name string `xml:"name,attr"`
	}
	if err := xml.Unmarshal([]byte(filterXML), &f); err != nil || f.Name == "" {
		panic(fmt.Sprintf("network/filter.xml: %v", err))
	}
	return f.Name
}()

// EnsureFilter defines kvbox's network filter in libvirt unless it is
// there. Two kvbox commands may race to define it: the loser finds it.
func EnsureFilter(conn *libvirt.Connect) error {
	if f, err := conn.LookupNWFilterByName(FilterName); err == nil {
		f.Free()
		return nil
	} else if !isLibvirt(err, libvirt.ERR_NO_NWFILTER) {
		return fmt.Errorf("look up network filter %s: %w", FilterName, err)
	}
	f, err := conn.NWFilterDefineXML(filterXML)
	if err != nil {
		if f2, err2 := conn.LookupNWFilterByName(FilterName); err2 == nil {
			f2.Free()
			return nil
		}
		return fmt.Errorf("define network filter %s (is libvirt's nwfilter driver installed? Debian: libvirt-daemon-driver-nwfilter): %w", FilterName, err)
	}
	f.Free()
	return nil
}

func isLibvirt(err error, code libvirt.ErrorNumber) bool {
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == code
}
