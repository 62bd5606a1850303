package qmp

import "testing"

func TestParseRAMBlockOffset(t *testing.T) {
	out := "              Block Name    PSize              Offset               Used              Total                HVA  RO\r\n" +
		"               kvbox.ram    4 KiB  0x0000000000000000 0x0000000100000000 0x0000000100000000 0x00007efb07fff000  rw\r\n" +
		"                 pc.bios    4 KiB  0x0000000100000000 0x0000000000040000 0x0000000000040000 0x00007efc59600000  ro\r\n" +
		"                  pc.ram    2 MiB  0x0000000100240000 0x0000000020000000 0x0000000020000000 0x00007efc59600000  rw\r\n"
	for _, c := range []struct {
		name string
		off  uint64
		ok   bool
	}{{"kvbox.ram", 0, true}, {"pc.ram", 0x100240000, true}, {"vga.vram", 0, false}} {
		off, ok, err := parseRAMBlockOffset(out, c.name)
		if err != nil || off != c.off || ok != c.ok {
			t.Errorf("%s: %#x %v %v, want %#x %v", c.name, off, ok, err, c.off, c.ok)
		}
	}
	if _, _, err := parseRAMBlockOffset(" kvbox.ram 4 KiB zz 0x1\n", "kvbox.ram"); err == nil {
		t.Error("a bad offset was read")
	}
}
