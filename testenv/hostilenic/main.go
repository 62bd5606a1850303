// Command hostilenic runs as root inside a box for TestHostileFramesReachNoHost:
// it is the box that sends, on its NIC, whatever it likes toward the host,
// on every path the host's kernel offers. It prints, as JSON, how many
// frames it sent, which TCP connections to the host opened, and every frame
// the host sent back that answers one of its probes.
//
// Two ways out. Raw frames (an AF_PACKET socket): to each destination MAC
// it is given (the reserved link-local group addresses 01:80:c2:00:00:0X,
// which a Linux bridge does not forward but hands up its port's own stack;
// broadcast; multicast; the bridge's and its tap's MAC), from its own and a
// spoofed MAC with its own and a spoofed address: IPv4 and IPv6 UDP, TCP
// SYN and echo requests to every host address, ARP requests and claims, ND
// solicitations and advertisements, and a router advertisement. Then the
// guest's own TCP/UDP stack: the host's addresses are pinned, in the box's
// neighbour table, to one link-local group MAC after the other, and it
// dials the host's TCP listener and writes to its UDP one on each.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// config is what the test gives, as JSON in -config.
type config struct {
	MAC      string   `json:"mac"`       // the box's own MAC (finds its NIC)
	IP       string   `json:"ip"`        // its own address
	Gateway  string   `json:"gateway"`   // the host's address on the bridge
	Prefix   int      `json:"prefix"`    // the bridge subnet's prefix length
	SpoofMAC string   `json:"spoof_mac"` // a MAC that is not the box's
	SpoofIP  string   `json:"spoof_ip"`  // an address that is not the box's
	Dests    []string `json:"dests"`     // destination MACs of raw frames
	Pinned   []string `json:"pinned"`    // MACs the host's addresses are pinned to, in turn
	HostV4   []string `json:"host_v4"`   // every IPv4 address of the host
	HostV6   []string `json:"host_v6"`   // every IPv6 address of the host
	Port     int      `json:"port"`      // the host's TCP and UDP listeners
	Tag      string   `json:"tag"`       // payload marker the listeners look for
	DialMS   int      `json:"dial_ms"`   // how long one kernel dial may take
}

// report is what it prints.
type report struct {
	Iface     string   `json:"iface"`
	Sent      int      `json:"sent"`      // raw frames
	Dialed    int      `json:"dialed"`    // kernel TCP dials
	Connected []string `json:"connected"` // dials the host accepted
	Answers   []string `json:"answers"`   // frames that answer a probe
	Errors    []string `json:"errors"`
}

// probePort is the source port of every raw TCP/UDP probe; probeID the
// echo identifier: the host's answers are told apart by them.
const (
	probePort = 47001
	probeID   = 0x4b56
)

func main() {
	cfgJSON := flag.String("config", "", "JSON configuration")
	flag.Parse()
	var cfg config
	if err := json.Unmarshal([]byte(*cfgJSON), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "hostilenic: -config:", err)
		os.Exit(2)
	}
	r, err := run(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "hostilenic:", err)
		os.Exit(1)
	}
	json.NewEncoder(os.Stdout).Encode(r)
}

type identity struct {
	mac  net.HardwareAddr
	ip4  net.IP
	ip6  net.IP // link-local, from the MAC
	name string
}

func run(cfg config) (*report, error) {
	own, err := net.ParseMAC(cfg.MAC)
	if err != nil {
		return nil, err
	}
	spoof, err := net.ParseMAC(cfg.SpoofMAC)
	if err != nil {
		return nil, err
	}
	ifc, err := nicByMAC(own)
	if err != nil {
		return nil, err
	}
	rep := &report{Iface: ifc.Name}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return nil, fmt.Errorf("packet socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifc.Index}); err != nil {
		return nil, fmt.Errorf("bind to %s: %w", ifc.Name, err)
	}
	// Frames the host sends to the spoofed MAC count too.
	mreq := unix.PacketMreq{Ifindex: int32(ifc.Index), Type: unix.PACKET_MR_PROMISC}
	if err := unix.SetsockoptPacketMreq(fd, unix.SOL_PACKET, unix.PACKET_ADD_MEMBERSHIP, &mreq); err != nil {
		return nil, fmt.Errorf("promiscuous %s: %w", ifc.Name, err)
	}
	ip4, spoofIP := net.ParseIP(cfg.IP).To4(), net.ParseIP(cfg.SpoofIP).To4()
	ids := []identity{
		{own, ip4, linkLocal(own), "own MAC and address"},
		{spoof, ip4, linkLocal(spoof), "spoofed MAC"},
		{own, spoofIP, linkLocal(own), "spoofed address"},
		{spoof, spoofIP, linkLocal(spoof), "spoofed MAC and address"},
	}
	hosts := map[string]bool{}
	for _, a := range append(append([]string(nil), cfg.HostV4...), cfg.HostV6...) {
		hosts[net.ParseIP(a).String()] = true
	}
	w := &watcher{fd: fd, hosts: hosts, spoofMAC: spoof, spoofIP: spoofIP}
	go w.read()

	s := &sender{fd: fd, ifindex: ifc.Index}
	for _, d := range cfg.Dests {
		dst, err := net.ParseMAC(d)
		if err != nil {
			return nil, err
		}
		for _, id := range ids {
			s.probes(cfg, dst, id)
		}
	}
	rep.Sent = s.sent
	if s.err != nil {
		rep.Errors = append(rep.Errors, s.err.Error())
	}
	if err := dialPinned(cfg, ifc, rep); err != nil {
		rep.Errors = append(rep.Errors, err.Error())
	}
	// Answers to the last frames are on their way.
	time.Sleep(time.Second)
	rep.Answers = w.seen()
	return rep, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func nicByMAC(mac net.HardwareAddr) (*net.Interface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	for i := range ifs {
		if ifs[i].HardwareAddr.String() == mac.String() {
			return &ifs[i], nil
		}
	}
	return nil, fmt.Errorf("no interface has MAC %s", mac)
}

// linkLocal is the EUI-64 link-local IPv6 address of a MAC.
func linkLocal(m net.HardwareAddr) net.IP {
	ip := make(net.IP, 16)
	ip[0], ip[1] = 0xfe, 0x80
	ip[8], ip[9], ip[10], ip[11] = m[0]^2, m[1], m[2], 0xff
	ip[12], ip[13], ip[14], ip[15] = 0xfe, m[3], m[4], m[5]
	return ip
}

type sender struct {
	fd      int
	ifindex int
	sent    int
	err     error
}

func (s *sender) send(ls ...gopacket.SerializableLayer) {
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ls...); err != nil {
		s.err = err
		return
	}
	to := &unix.SockaddrLinklayer{Ifindex: s.ifindex, Halen: 6}
	if err := unix.Sendto(s.fd, buf.Bytes(), 0, to); err != nil {
		s.err = fmt.Errorf("send: %w", err)
		return
	}
	s.sent++
	// Paced: the tap's queue on the host side must not drop what it
	// would have delivered.
	time.Sleep(200 * time.Microsecond)
}

func eth(dst net.HardwareAddr, id identity, t layers.EthernetType) *layers.Ethernet {
	return &layers.Ethernet{SrcMAC: id.mac, DstMAC: dst, EthernetType: t}
}

// probes sends, to one destination MAC and as one identity, everything
// that would reach a host socket or change the host's state if the host
// took it.
func (s *sender) probes(cfg config, dst net.HardwareAddr, id identity) {
	payload := gopacket.Payload(fmt.Sprintf("%s raw %s to %s", cfg.Tag, id.name, dst))
	s.probesV4(cfg, dst, id, payload)
	s.arpClaims(cfg, dst, id)
	s.probesV6(cfg, dst, id, payload)
	s.routerAdvertisement(dst, id)
}

// probesV4 sends to each host IPv4 address, and to the broadcast and
// all-hosts addresses: a UDP datagram, a TCP SYN, an echo request and an
// ARP request.
func (s *sender) probesV4(cfg config, dst net.HardwareAddr, id identity, payload gopacket.Payload) {
	v4 := append([]string(nil), cfg.HostV4...)
	v4 = append(v4, "255.255.255.255", "224.0.0.1", broadcast(cfg.Gateway, cfg.Prefix))
	for _, a := range v4 {
		to := net.ParseIP(a).To4()
		ip := func(p layers.IPProtocol) *layers.IPv4 {
			return &layers.IPv4{Version: 4, TTL: 64, Protocol: p, SrcIP: id.ip4, DstIP: to}
		}
		udp := &layers.UDP{SrcPort: probePort, DstPort: layers.UDPPort(cfg.Port)}
		u := ip(layers.IPProtocolUDP)
		udp.SetNetworkLayerForChecksum(u)
		s.send(eth(dst, id, layers.EthernetTypeIPv4), u, udp, payload)
		tcp := &layers.TCP{SrcPort: probePort, DstPort: layers.TCPPort(cfg.Port), Seq: 1, SYN: true, Window: 64240}
		t := ip(layers.IPProtocolTCP)
		tcp.SetNetworkLayerForChecksum(t)
		s.send(eth(dst, id, layers.EthernetTypeIPv4), t, tcp)
		s.send(eth(dst, id, layers.EthernetTypeIPv4), ip(layers.IPProtocolICMPv4),
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(layers.ICMPv4TypeEchoRequest, 0), Id: probeID, Seq: 1})
		// Who has this host address? (A host that answers learns the
		// asker on whichever interface took the frame.)
		s.send(eth(dst, id, layers.EthernetTypeARP), arp(layers.ARPRequest, id.mac, id.ip4, net.HardwareAddr{0, 0, 0, 0, 0, 0}, to))
	}
}

// arpClaims sends ARP claims: this MAC is the gateway's and the spoofed
// address's.
func (s *sender) arpClaims(cfg config, dst net.HardwareAddr, id identity) {
	gw := net.ParseIP(cfg.Gateway).To4()
	for _, claim := range []net.IP{gw, net.ParseIP(cfg.SpoofIP).To4()} {
		s.send(eth(dst, id, layers.EthernetTypeARP), arp(layers.ARPRequest, id.mac, claim, net.HardwareAddr{0, 0, 0, 0, 0, 0}, claim))
		s.send(eth(dst, id, layers.EthernetTypeARP), arp(layers.ARPReply, id.mac, claim, id.mac, gw))
	}
}

// probesV6 sends to each host IPv6 address, and to all nodes: a UDP
// datagram, a TCP SYN, an echo request, a neighbour solicitation and a
// neighbour advertisement.
func (s *sender) probesV6(cfg config, dst net.HardwareAddr, id identity, payload gopacket.Payload) {
	v6 := append([]string(nil), cfg.HostV6...)
	v6 = append(v6, "ff02::1")
	for _, a := range v6 {
		to := net.ParseIP(a)
		ip := func(p layers.IPProtocol, hop uint8) *layers.IPv6 {
			return &layers.IPv6{Version: 6, HopLimit: hop, NextHeader: p, SrcIP: id.ip6, DstIP: to}
		}
		u := ip(layers.IPProtocolUDP, 64)
		udp := &layers.UDP{SrcPort: probePort, DstPort: layers.UDPPort(cfg.Port)}
		udp.SetNetworkLayerForChecksum(u)
		s.send(eth(dst, id, layers.EthernetTypeIPv6), u, udp, payload)
		t := ip(layers.IPProtocolTCP, 64)
		tcp := &layers.TCP{SrcPort: probePort, DstPort: layers.TCPPort(cfg.Port), Seq: 1, SYN: true, Window: 64240}
		tcp.SetNetworkLayerForChecksum(t)
		s.send(eth(dst, id, layers.EthernetTypeIPv6), t, tcp)
		e := ip(layers.IPProtocolICMPv6, 64)
		echo := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeEchoRequest, 0)}
		echo.SetNetworkLayerForChecksum(e)
		s.send(eth(dst, id, layers.EthernetTypeIPv6), e, echo, &layers.ICMPv6Echo{Identifier: probeID, SeqNumber: 1})
		// Neighbour solicitation for the host's address, naming this MAC,
		// and an advertisement that claims it for this MAC.
		n := ip(layers.IPProtocolICMPv6, 255)
		ns := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeNeighborSolicitation, 0)}
		ns.SetNetworkLayerForChecksum(n)
		s.send(eth(dst, id, layers.EthernetTypeIPv6), n, ns, &layers.ICMPv6NeighborSolicitation{TargetAddress: to,
			Options: layers.ICMPv6Options{{Type: layers.ICMPv6OptSourceAddress, Data: id.mac}}})
		n = ip(layers.IPProtocolICMPv6, 255)
		n.DstIP = net.ParseIP("ff02::1")
		na := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeNeighborAdvertisement, 0)}
		na.SetNetworkLayerForChecksum(n)
		s.send(eth(dst, id, layers.EthernetTypeIPv6), n, na, &layers.ICMPv6NeighborAdvertisement{Flags: 0x20, TargetAddress: to,
			Options: layers.ICMPv6Options{{Type: layers.ICMPv6OptTargetAddress, Data: id.mac}}})
	}
}

// routerAdvertisement sends a router advertisement: a default route
// through this box, a prefix to make addresses from, a hop limit, an MTU
// and neighbour timers for the interface that takes it.
func (s *sender) routerAdvertisement(dst net.HardwareAddr, id identity) {
	ra := &layers.IPv6{Version: 6, HopLimit: 255, NextHeader: layers.IPProtocolICMPv6, SrcIP: id.ip6, DstIP: net.ParseIP("ff02::1")}
	icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeRouterAdvertisement, 0)}
	icmp.SetNetworkLayerForChecksum(ra)
	prefix := make([]byte, 30)
	prefix[0], prefix[1] = 64, 0xc0 // on-link, autonomous
	binary.BigEndian.PutUint32(prefix[2:], 86400)
	binary.BigEndian.PutUint32(prefix[6:], 14400)
	copy(prefix[14:], net.ParseIP("2001:db8:6b76::"))
	mtu := make([]byte, 6)
	binary.BigEndian.PutUint32(mtu[2:], 1280)
	s.send(eth(dst, id, layers.EthernetTypeIPv6), ra, icmp, &layers.ICMPv6RouterAdvertisement{
		HopLimit: 7, RouterLifetime: 1800, ReachableTime: 12345, RetransTimer: 2345,
		Options: layers.ICMPv6Options{
			{Type: layers.ICMPv6OptSourceAddress, Data: id.mac},
			{Type: layers.ICMPv6OptPrefixInfo, Data: prefix},
			{Type: layers.ICMPv6OptMTU, Data: mtu},
		},
	})
}

func arp(op uint16, sha net.HardwareAddr, spa net.IP, tha net.HardwareAddr, tpa net.IP) *layers.ARP {
	return &layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4, HwAddressSize: 6, ProtAddressSize: 4,
		Operation: op, SourceHwAddress: sha, SourceProtAddress: spa.To4(), DstHwAddress: tha, DstProtAddress: tpa.To4()}
}

// broadcast is the broadcast address of the subnet of gw/prefix.
func broadcast(gw string, prefix int) string {
	p := netip.PrefixFrom(netip.MustParseAddr(gw), prefix).Masked()
	b := p.Addr().As4()
	for i := prefix; i < 32; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	return netip.AddrFrom4(b).String()
}

// watcher records frames the host sends back that answer a raw probe.
type watcher struct {
	fd       int
	hosts    map[string]bool
	spoofMAC net.HardwareAddr
	spoofIP  net.IP
	mu       sync.Mutex
	answers  []string
}

func (w *watcher) seen() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.answers...)
}

func (w *watcher) read() {
	buf := make([]byte, 65536)
	for {
		n, from, err := unix.Recvfrom(w.fd, buf, 0)
		if err != nil {
			return
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		p := gopacket.NewPacket(append([]byte(nil), buf[:n]...), layers.LayerTypeEthernet, gopacket.Default)
		if why := w.answer(p); why != "" {
			e := p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
			w.mu.Lock()
			w.answers = append(w.answers, fmt.Sprintf("%s (from %s to %s)", why, e.SrcMAC, e.DstMAC))
			w.mu.Unlock()
		}
	}
}

// answer says why a frame answers a probe, or "".
func (w *watcher) answer(p gopacket.Packet) string {
	var src string
	if l, ok := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok {
		src = l.SrcIP.String()
	} else if l, ok := p.Layer(layers.LayerTypeIPv6).(*layers.IPv6); ok {
		src = l.SrcIP.String()
	}
	switch {
	case p.Layer(layers.LayerTypeTCP) != nil:
		t := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
		if t.DstPort == probePort {
			return fmt.Sprintf("TCP %s from %s:%d", flags(t), src, t.SrcPort)
		}
	case p.Layer(layers.LayerTypeICMPv4) != nil:
		c := p.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4)
		switch c.TypeCode.Type() {
		case layers.ICMPv4TypeEchoReply:
			if c.Id == probeID {
				return "ICMP echo reply from " + src
			}
		case layers.ICMPv4TypeDestinationUnreachable:
			// The host's own stack refusing what it took; a network or
			// host unreachable is the gateway routing, as for any box.
			if code := c.TypeCode.Code(); code == layers.ICMPv4CodeProtocol || code == layers.ICMPv4CodePort {
				return fmt.Sprintf("ICMP %s from %s", c.TypeCode, src)
			}
		case layers.ICMPv4TypeRedirect:
			return fmt.Sprintf("ICMP %s from %s", c.TypeCode, src)
		}
	case p.Layer(layers.LayerTypeICMPv6) != nil:
		c := p.Layer(layers.LayerTypeICMPv6).(*layers.ICMPv6)
		switch c.TypeCode.Type() {
		case layers.ICMPv6TypeEchoReply:
			if e, ok := p.Layer(layers.LayerTypeICMPv6Echo).(*layers.ICMPv6Echo); ok && e.Identifier == probeID {
				return "ICMPv6 echo reply from " + src
			}
		case layers.ICMPv6TypeDestinationUnreachable, layers.ICMPv6TypePacketTooBig, layers.ICMPv6TypeTimeExceeded, layers.ICMPv6TypeParameterProblem:
			return fmt.Sprintf("ICMPv6 %s from %s", c.TypeCode, src)
		case layers.ICMPv6TypeNeighborAdvertisement:
			if w.hosts[src] {
				return "neighbour advertisement from " + src
			}
		case layers.ICMPv6TypeNeighborSolicitation:
			// The host resolving a spoofed address to answer it.
			if ns, ok := p.Layer(layers.LayerTypeICMPv6NeighborSolicitation).(*layers.ICMPv6NeighborSolicitation); ok && ns.TargetAddress.Equal(linkLocal(w.spoofMAC)) {
				return "neighbour solicitation for the spoofed " + ns.TargetAddress.String()
			}
		}
	case p.Layer(layers.LayerTypeARP) != nil:
		a := p.Layer(layers.LayerTypeARP).(*layers.ARP)
		tpa := net.IP(a.DstProtAddress)
		switch {
		case a.Operation == layers.ARPReply && (tpa.Equal(w.spoofIP) || net.HardwareAddr(a.DstHwAddress).String() == w.spoofMAC.String()):
			return fmt.Sprintf("ARP reply %s is-at %s to the spoofed %s", net.IP(a.SourceProtAddress), net.HardwareAddr(a.SourceHwAddress), tpa)
		case a.Operation == layers.ARPRequest && tpa.Equal(w.spoofIP):
			return "ARP request for the spoofed " + tpa.String()
		}
	}
	return ""
}

func flags(t *layers.TCP) string {
	var f []string
	for _, x := range []struct {
		on bool
		n  string
	}{{t.SYN, "SYN"}, {t.ACK, "ACK"}, {t.RST, "RST"}, {t.FIN, "FIN"}} {
		if x.on {
			f = append(f, x.n)
		}
	}
	return strings.Join(f, "+")
}

// dialPinned pins each of the host's addresses the guest would reach
// through its NIC to one MAC of cfg.Pinned after the other, in its
// neighbour table, and dials the host's listeners through its own stack:
// real TCP connections and UDP datagrams, as any program in a box makes.
// IPv6 is turned on on the NIC meanwhile (the agent turns it off).
func dialPinned(cfg config, ifc *net.Interface, rep *report) error {
	link, err := netlink.LinkByIndex(ifc.Index)
	if err != nil {
		return err
	}
	restore, err := ipv6Settings(ifc.Name)
	if err != nil {
		return err
	}
	defer restore()
	if err := enableIPv6(link, ifc.Name); err != nil {
		return err
	}
	targets, neighbours := pinTargets(cfg)
	defer func() {
		for _, n := range neighbours {
			netlink.NeighDel(&netlink.Neigh{LinkIndex: ifc.Index, IP: n})
		}
	}()
	dialTimeout := time.Duration(cfg.DialMS) * time.Millisecond
	for _, m := range cfg.Pinned {
		mac, err := net.ParseMAC(m)
		if err != nil {
			return err
		}
		if err := pin(ifc, neighbours, mac); err != nil {
			return err
		}
		dialAll(cfg, ifc, targets, mac, dialTimeout, rep)
	}
	return nil
}

// ipv6Settings reads the NIC's IPv6 settings dialPinned changes;
// restore writes them back.
func ipv6Settings(ifname string) (restore func(), err error) {
	conf := "/proc/sys/net/ipv6/conf/" + ifname + "/"
	was := map[string]string{}
	for _, k := range []string{"accept_dad", "disable_ipv6"} {
		b, err := os.ReadFile(conf + k)
		if err != nil {
			return nil, err
		}
		was[k] = string(b)
	}
	return func() {
		for _, k := range []string{"disable_ipv6", "accept_dad"} {
			os.WriteFile(conf+k, []byte(was[k]), 0o644)
		}
	}, nil
}

// enableIPv6 turns IPv6 on on the NIC, without duplicate address
// detection, and waits for the guest's own link-local address, without
// which it sends no IPv6.
func enableIPv6(link netlink.Link, ifname string) error {
	conf := "/proc/sys/net/ipv6/conf/" + ifname + "/"
	os.WriteFile(conf+"accept_dad", []byte("0\n"), 0o644)
	if err := os.WriteFile(conf+"disable_ipv6", []byte("0\n"), 0o644); err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		as, _ := netlink.AddrList(link, netlink.FAMILY_V6)
		if len(as) > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no IPv6 link-local address on %s", ifname)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pinTargets is what the guest reaches through its NIC: the host
// addresses it dials (not loopback ones, which are the guest's own; the
// link-local IPv6 ones), and the neighbours they are reached through (the
// gateway, every address beyond it is reached through it, and those
// link-local addresses).
func pinTargets(cfg config) (targets, neighbours []net.IP) {
	neighbours = []net.IP{net.ParseIP(cfg.Gateway)}
	for _, a := range cfg.HostV4 {
		if ip := net.ParseIP(a); !ip.IsLoopback() {
			targets = append(targets, ip)
		}
	}
	for _, a := range cfg.HostV6 {
		if ip := net.ParseIP(a); ip.IsLinkLocalUnicast() {
			targets = append(targets, ip)
			neighbours = append(neighbours, ip)
		}
	}
	return targets, neighbours
}

// pin sets each neighbour to mac in the guest's neighbour table, for good.
func pin(ifc *net.Interface, neighbours []net.IP, mac net.HardwareAddr) error {
	for _, n := range neighbours {
		fam := netlink.FAMILY_V4
		if n.To4() == nil {
			fam = netlink.FAMILY_V6
		}
		if err := netlink.NeighSet(&netlink.Neigh{LinkIndex: ifc.Index, Family: fam, IP: n, HardwareAddr: mac, State: netlink.NUD_PERMANENT}); err != nil {
			return fmt.Errorf("pin %s to %s: %w", n, mac, err)
		}
	}
	return nil
}

// dialAll writes a UDP datagram to each target and dials it over TCP, all
// dials at once, each within dialTimeout; what the host accepted goes to
// rep.
func dialAll(cfg config, ifc *net.Interface, targets []net.IP, mac net.HardwareAddr, dialTimeout time.Duration, rep *report) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, to := range targets {
		host := to.String()
		if to.IsLinkLocalUnicast() {
			host += "%" + ifc.Name
		}
		addr := net.JoinHostPort(host, fmt.Sprint(cfg.Port))
		msg := fmt.Sprintf("%s kernel via %s to %s", cfg.Tag, mac, addr)
		if u, err := net.Dial("udp", addr); err == nil {
			u.Write([]byte(msg))
			u.Close()
		}
		wg.Add(1)
		rep.Dialed++
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
			defer cancel()
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return
			}
			c.Write([]byte(msg))
			c.Close()
			mu.Lock()
			rep.Connected = append(rep.Connected, msg)
			mu.Unlock()
		}()
	}
	wg.Wait()
}
