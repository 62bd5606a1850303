package revert

import (
	"slices"
	"testing"
)

func TestFailRunsNewestFirst(t *testing.T) {
	var got []int
	r := New()
	for i := range 3 {
		r.Add(func() { got = append(got, i) })
	}
	r.Fail()
	r.Fail()
	if !slices.Equal(got, []int{2, 1, 0}) {
		t.Fatalf("undo order = %v, want [2 1 0] once", got)
	}
}

func TestSuccessKeepsSteps(t *testing.T) {
	ran := false
	r := New()
	r.Add(func() { ran = true })
	r.Success()
	r.Fail()
	if ran {
		t.Fatal("undo ran after Success")
	}
}

func TestCloneHandsStepsToCaller(t *testing.T) {
	var got []int
	r := New()
	r.Add(func() { got = append(got, 1) })
	c := r.Clone()
	r.Success()
	r.Fail()
	if len(got) != 0 {
		t.Fatalf("original undid after Success: %v", got)
	}
	c.Add(func() { got = append(got, 2) })
	c.Fail()
	if !slices.Equal(got, []int{2, 1}) {
		t.Fatalf("clone undo = %v, want [2 1]", got)
	}
}
